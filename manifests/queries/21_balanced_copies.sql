-- requires: balanced
-- How many samples the resampling dropped, kept once, or repeated.
SELECT copies, count(*) AS samples, round(avg(weight), 4) AS mean_weight
FROM balanced GROUP BY copies ORDER BY copies
