-- requires: alignment
-- Image–text alignment per source and status: the CLIP score's spread and the cut applied (low_alignment below it).
SELECT folder, source, status, count(*) AS samples, round(min(score), 4) AS min_score, round(median(score), 4) AS median_score,
       round(any_value(threshold), 4) AS cut
FROM alignment GROUP BY ALL ORDER BY folder, source, samples DESC
