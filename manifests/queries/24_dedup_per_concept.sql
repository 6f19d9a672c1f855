-- requires: dedup, assignments
-- The concepts near-duplicate removal takes most from (every top-K concept of an image counts, as balance counts).
SELECT c AS concept_id, count(*) AS images, count(*) FILTER (WHERE d.status = 'near_duplicate') AS removed,
       round(count(*) FILTER (WHERE d.status = 'near_duplicate') / count(*), 4) AS removed_share
FROM (SELECT sample_id, unnest(concept_ids) AS c FROM assignments) JOIN dedup d USING (sample_id)
GROUP BY c HAVING removed > 0 ORDER BY removed DESC, concept_id LIMIT 10
