-- requires: samples
-- Ingested samples by source and status: what was read, what was broken and why.
SELECT source, status, count(*) AS samples, any_value(error) AS example_error
FROM samples
GROUP BY ALL
ORDER BY source, samples DESC
