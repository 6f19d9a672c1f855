"""GRPO-side training systems, kept beside the RL selection steps but used by none of them: the group
advantages and decoupled PPO loss (`loss`), SortedRL's length-sorted rollout scheduling (`sortedrl`, on the request-level engines of `engines`) and
Shuffle-R1's advantage batch shuffling (`shuffle_r1`). docs/grpo.md."""
