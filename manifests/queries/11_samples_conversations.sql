-- requires: samples
-- Conversation statistics of the ok samples per ingest step, source and category: turns, images per sample, text-only and multi-image shares.
SELECT folder, source, category, count(*) AS samples,
       round(avg(turns), 2) AS mean_turns, max(turns) AS max_turns,
       round(avg(n_images), 2) AS mean_images, max(n_images) AS max_images,
       count(*) FILTER (WHERE n_images = 0) AS text_only,
       count(*) FILTER (WHERE n_images > 1) AS multi_image
FROM samples
WHERE status = 'ok'
GROUP BY ALL
ORDER BY folder, source, samples DESC
