-- requires: selection
-- Per category: kept vs dropped prompts, and mean Pass@1 / Pass@N / gap over all its prompts.
SELECT category, count(*) FILTER (WHERE kept) AS kept, count(*) FILTER (WHERE NOT kept) AS dropped,
       count(*) FILTER (WHERE split = 'stage2-cot') AS cot, round(avg(pass_at_1), 3) AS mean_pass_at_1,
       round(avg(pass_at_n), 3) AS mean_pass_at_n, round(avg(gap), 3) AS mean_gap
FROM selection GROUP BY category ORDER BY kept DESC, category
