-- requires: balanced
-- How many samples the resampling dropped, kept once, or repeated.
SELECT folder, copies, count(*) AS samples, round(avg(weight), 4) AS mean_weight
FROM balanced GROUP BY folder, copies ORDER BY folder, copies
