"""The pretraining trainer, in parts (torchtitan's shape on megatron-core's stack):

| module | part |
| --- | --- |
| ``config`` | ``TrainConfig``: every knob of a stage, validated before any work |
| ``build`` | process groups, the VLM of this rank |
| ``optimizer`` | DDP + megatron's optimizer (torch's fused and ``_foreach`` kernels on CUDA), the lr schedule |
| ``checkpoint`` | the one checkpoint module: atomic megatron dist checkpoints, where a stage starts, when to save |
| ``cpu_compat`` | what megatron-core needs patched to run on a CPU (CPU runs only, entered by ``build.setup_distributed``) |
| ``loader`` | this rank's prepared micro-batches from the loader's saved position |
| ``flops`` | model and hardware FLOPs of a micro-batch (MFU, HFU) |
| ``metrics`` | per-step records: ``metrics.jsonl``, tensorboard, the log, the ``train_metrics`` manifest |
| ``loop`` | ``Trainer``: the parts put together, the step, the loop |

``pretrain.train`` is the entry point (``train(cfg)`` and the CLI).
"""
