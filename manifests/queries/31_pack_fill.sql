-- requires: packs
-- Packed sequences per pack step: how many, how full (tokens per pack; the report.md of each pack step gives
-- fill vs seq_len). Each step is its own row: pack, pack-align, pack-instruct and import-packs are different sets.
SELECT folder, count(*) AS packs, sum(len(sample_ids)) AS samples, sum(total_tokens) AS tokens,
       round(avg(len(sample_ids)), 2) AS mean_samples_per_pack,
       min(total_tokens) AS min_tokens, round(avg(total_tokens), 1) AS mean_tokens, max(total_tokens) AS max_tokens,
       count(DISTINCT shard) AS shards
FROM packs
GROUP BY folder
ORDER BY folder
