"""Pretraining on packed sequences with megatron-core (work in progress: the LLM side, its packed
THD attention and the CPU path are here; the RICE-ViT tower, stages and launch are not yet)."""
