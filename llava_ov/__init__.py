"""The published LLaVA-OneVision-1.5 format, below both the trainer (``pretrain``) and the generation
backends (``inference``), so neither reaches into the other for it:

| module | what |
| --- | --- |
| ``official`` | the official modeling class, found in the installed lmms-engine wheel, and the transformers range it runs under |
| ``qwen3`` | Qwen3 LLM weights: Hugging Face names ⇄ megatron-core's (fused QKV, ``[gate; up]``) |
| ``convert`` | the whole model: our state dict ⇄ the published names, its ``config.json``, the recipe check |
| ``export`` | one published folder written from our weights (safetensors shards, config, tokenizer, processor) |

It imports only the core (``ovpipe``, ``manifests``) and third-party libraries; the shapes it needs come
in as arguments (a recipe's ``.vit`` / ``.llm``)."""
