-- requires: mixed
-- The mixed instruction set per category and source: distinct samples drawn, copies, and each one's share of the copies (the mix step's report.md sets these against the shares before mixing and the asked proportions).
SELECT folder, category, source, count(*) AS samples, sum(copies)::BIGINT AS copies, max(copies) AS max_copies,
       round(sum(copies) / sum(sum(copies)) OVER (PARTITION BY folder), 4) AS share_of_copies,
       round(sum(sum(copies)) OVER (PARTITION BY folder, category) / sum(sum(copies)) OVER (PARTITION BY folder), 4)
           AS category_share
FROM mixed
GROUP BY folder, category, source
ORDER BY folder, category, source
