-- requires: rl_prompts
-- Prompts per source and answer type (benchmark sets and VLM-Gym games alike).
SELECT folder, source, answer_type, status, count(*) AS prompts FROM rl_prompts GROUP BY ALL
ORDER BY folder, source, status
