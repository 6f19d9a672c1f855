-- requires: rollouts
-- Rollouts per rollout step (rollout, rollout-vlm, … are different policies: never one sum), by prompt type: prompts, responses per prompt, mean response tokens.
SELECT folder, backend, prompt_type, count(DISTINCT prompt_id) AS prompts, count(*) AS rollouts,
       round(count(*) / count(DISTINCT prompt_id), 2) AS per_prompt, round(avg(tokens), 1) AS mean_tokens
FROM rollouts
GROUP BY ALL
ORDER BY folder, backend, prompt_type
