-- requires: selection
-- RL prompts kept and dropped, by source and reason, with their mean pass rates.
SELECT folder, source, reason, split, count(*) AS prompts, round(avg(pass_at_1), 3) AS mean_pass_at_1,
       round(avg(pass_at_n), 3) AS mean_pass_at_n
FROM selection GROUP BY ALL ORDER BY folder, source, prompts DESC
