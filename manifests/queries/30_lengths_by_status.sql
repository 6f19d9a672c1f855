-- requires: lengths
-- Token lengths per status (ok / truncated / too_long / carried-over ingest failures), per lengths step.
SELECT folder, status, count(*) AS samples,
       round(avg(text_tokens), 1) AS mean_text_tokens, round(avg(image_tokens), 1) AS mean_image_tokens,
       round(avg(total_tokens), 1) AS mean_total_tokens, max(total_tokens) AS max_total_tokens
FROM lengths GROUP BY folder, status ORDER BY folder, samples DESC
