-- requires: lengths, samples
-- Tokens per category and images per sample (per lengths step, packable rows): what each kind of conversation costs in the sequence, and how much of it is trained on.
SELECT l.folder, s.category, s.n_images, count(*) AS samples,
       round(avg(l.total_tokens), 1) AS mean_total_tokens, round(avg(l.image_tokens), 1) AS mean_image_tokens,
       round(avg(l.target_tokens), 1) AS mean_target_tokens,
       round(sum(l.target_tokens) / nullif(sum(l.total_tokens), 0), 3) AS target_share
FROM lengths l JOIN (SELECT DISTINCT sample_id, category, n_images FROM samples) s USING (sample_id)
WHERE l.status IN ('ok', 'truncated')
GROUP BY ALL
ORDER BY l.folder, s.category, s.n_images
