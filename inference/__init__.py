"""VLM generation backends shared by `recaption` and `rollout` (transformers, vLLM, a JSONL file)."""
