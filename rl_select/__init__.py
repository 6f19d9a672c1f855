"""RL data selection: prompts → N rollouts → rule-based rewards → unbiased pass@k → keep the
prompts with a Pass@N − Pass@1 gap ("latent capability") → export for GRPO trainers."""
