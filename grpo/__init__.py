"""GRPO-side training systems, kept beside the RL selection steps but used by none of them: the group
advantages and decoupled PPO loss (`loss`), SortedRL's length-sorted rollout scheduling (`sortedrl`) and
Shuffle-R1's advantage batch shuffling (`shuffle_r1`). docs/grpo.md."""
