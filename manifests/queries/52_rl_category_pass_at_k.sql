-- requires: selection
-- Per category: kept vs dropped prompts, unscored prompts (n = 0, their rates are NULL and left out of the
-- means), and mean Pass@1 / Pass@4 (the typed pass_at_k map; NULL if 4 is not among select.ks) / Pass@N / gap.
SELECT folder, category, count(*) FILTER (WHERE kept) AS kept, count(*) FILTER (WHERE NOT kept) AS dropped,
       count(*) FILTER (WHERE split = 'stage2-cot') AS cot, count(*) FILTER (WHERE n = 0) AS unscored,
       round(avg(pass_at_1), 3) AS mean_pass_at_1, round(avg(pass_at_k[4]), 3) AS mean_pass_at_4,
       round(avg(pass_at_n), 3) AS mean_pass_at_n, round(avg(gap), 3) AS mean_gap
FROM selection GROUP BY folder, category ORDER BY folder, kept DESC, category
