-- requires: concept_counts
-- The most and least frequent concepts before balancing, and what balancing made of them.
(SELECT 'head' AS part, concept_id, text, count_before, count_after
 FROM concept_counts ORDER BY count_before DESC LIMIT 5)
UNION ALL
(SELECT 'tail' AS part, concept_id, text, count_before, count_after
 FROM concept_counts WHERE count_before > 0 ORDER BY count_before ASC LIMIT 5)
