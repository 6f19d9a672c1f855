"""Three-stage pretraining on packed sequences with megatron-core: the RICE-ViT tower, the projector and the
Qwen3-style LLM (``model``, ``vision``, ``vlm``), TP / PP / CP layouts (``parallel``), the packed THD loader
(``data``), the trainer (``trainer``; entry point ``train``), recipes, dist checkpoints, the HF export and
import, and the ``torchrun`` / ``srun`` launch."""
