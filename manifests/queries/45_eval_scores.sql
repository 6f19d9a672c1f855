-- requires: eval
-- lmms-eval scores of the exported model: one row per task × metric (value NULL when undefined).
SELECT task, metric, filter, round(value, 4) AS value, round(stderr, 4) AS stderr, n_samples, status,
       lmms_eval_version, model
FROM eval
ORDER BY task, metric, filter;
