"""The recipe's RL stage: the `grpo` step on TRL's GRPOTrainer (`step`, `trainer`), the group advantages and
decoupled PPO loss (`loss`), SortedRL's length-sorted rollout scheduling (`sortedrl`, on the request-level engines
of `engines`) and Shuffle-R1's batch reshaping (`shuffle_r1`, its symptoms in `symptoms`). docs/grpo.md."""
