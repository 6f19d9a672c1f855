-- requires: lengths
-- Distribution of per-sample total tokens (packable rows), in power-of-two buckets.
SELECT folder, CAST(pow(2, floor(log2(greatest(total_tokens, 1)))) AS BIGINT) AS tokens_from, count(*) AS samples
FROM lengths WHERE status IN ('ok', 'truncated') GROUP BY 1, 2 ORDER BY 1, 2
