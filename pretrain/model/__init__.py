"""The VLM: RICE-ViT (``vision``), the projector and the Qwen3-style LLM (``llm``) put together in ``vlm``;
packed (THD) attention and rotary (``attention``), fused kernels (``fused``) and the TP / CP / SP splits of a
packed batch (``parallel``). Nothing here knows about run folders, checkpoints or the loop."""
