-- requires: train_metrics
-- Per stage: steps, the loss at its first and last step (as `ovpipe summary` and `ovpipe status` give it),
-- tokens/s, MFU and HFU (mean), the mean step
-- time and the share of it spent waiting for data (NULL for steps recorded without the time split),
-- last grad norm.
SELECT stage,
       count(*)                                                        AS steps,
       round(arg_min(loss, step), 3)                                   AS loss_first,
       round(arg_max(loss, step), 3)                                   AS loss_last,
       round(avg(tokens_per_s), 1)                                     AS tokens_per_s,
       round(avg(mfu), 6)                                              AS mfu,
       round(avg(hfu), 6)                                              AS hfu,
       round(avg(step_s), 4)                                           AS step_s,
       round(sum(data_wait_s) / sum(step_s) FILTER (WHERE data_wait_s IS NOT NULL), 4) AS data_wait_share,
       round(arg_max(grad_norm, step), 4)                              AS last_grad_norm,
       sum(tokens)                                                     AS tokens,
       sum(images)                                                     AS images
FROM (SELECT *, max(step) OVER (PARTITION BY stage) AS max_step FROM train_metrics)
GROUP BY stage
ORDER BY stage;
