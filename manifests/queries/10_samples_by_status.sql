-- requires: samples
-- Ingested samples per ingest step, source and status: what was read, what was broken and why (the later
-- copies of a repeated sample, `duplicate`, are the sample_duplicates view).
SELECT folder, source, status, count(*) AS samples, any_value(error) AS example_error
FROM (SELECT folder, source, status, error FROM samples
      UNION ALL SELECT folder, source, status, error FROM sample_duplicates)
GROUP BY ALL
ORDER BY folder, source, samples DESC
