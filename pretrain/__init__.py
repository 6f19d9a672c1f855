"""Three-stage pretraining of RICE-ViT + projector + Qwen3 on packed sequences with megatron-core.

- ``model/``: the network (tower, projector, LLM, attention, fused kernels, parallel splits);
- ``trainer/``: the config (``TrainConfig``, resolved once), build, loop, one ``checkpoint`` module, metrics;
- ``recipes``: model sizes and stage settings; ``data``: the packed THD loader;
- ``stage``: each stage, ``export-model`` and ``import-model`` as ordinary ovpipe steps (``RUN/pretrain/...``);
- ``train``: the per-process entry point the step's ranks run.
The published LLaVA-OneVision-1.5 format lives below this package, in ``llava_ov``."""
