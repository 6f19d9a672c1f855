-- requires: dedup
-- Semantic dedup: kept (ok), near_duplicate (cosine to the kept duplicate_of > 1 − ε) and rows without a vector, per status.
SELECT folder, status, count(*) AS images, count(DISTINCT duplicate_of) AS kept_originals,
       round(min(similarity), 4) AS min_cosine, round(avg(similarity), 4) AS mean_cosine
FROM dedup GROUP BY folder, status ORDER BY folder, images DESC
