# pretrain: stages 1 → 1.5 → 2 of the `tiny` recipe on the demo's packed shards, on the CPU:
#   stage 1   projector only, one epoch of the LLaVA-558K-style alignment packs   (pack-align)
#   stage 1.5 everything, the concept-balanced caption packs                      (pack)
#   stage 2   everything, the mixed instruction packs (LLaVA JSON + FineVision)   (pack-instruct)
# then stage 2 exported as one LLaVA-OneVision-1.5 folder (HF_EXPORT) that lmms-eval and RL rollouts load.
# Each stage starts from the one before; the demo's stage 1 starts from random initialisation (--init
# scratch), where a real run first imports Qwen3 + RICE-ViT as stage 0 (`ovpipe import-model`, docs/pretrain.md).
DEMO_TARGETS += pretrain
PRETRAIN_STEPS ?= 30
# Stage 2 runs six times as long: it is what teaches the answer-only skills the demo's RL prompts ask
# (docs/rl_select.md); at PRETRAIN_STEPS its rollouts are at chance and selection has nothing to keep.
INSTRUCT_STEPS ?= $(shell expr 6 \* $(PRETRAIN_STEPS))
PRETRAIN_LR ?= 3e-3
ALIGN_EPOCHS ?= 1
HF_EXPORT ?= $(RUN)/pretrain/hf-stage-2
# EXECUTOR=slurm: one job per stage (the core's Slurm executor: srun starts each rank) on PRETRAIN_NODES nodes ×
# PRETRAIN_GPUS GPUs (0: a CPU node, one process — the loopback cluster), each afterok on the one before;
# the make waits on stage 2 only, then exports.
PRETRAIN_NODES ?= 1
PRETRAIN_GPUS ?= 0
PRETRAIN_SLURM = $(if $(filter slurm,$(EXECUTOR)),--executor slurm --nodes $(PRETRAIN_NODES) --gpus-per-node $(PRETRAIN_GPUS) $(SLURM_ARGS))
PRETRAIN_WAIT = $(if $(filter slurm,$(EXECUTOR)),--wait)

.PHONY: pretrain export-model
pretrain:
	$(OVPIPE) pretrain --recipe tiny --stage 1 --init scratch --run-dir $(RUN) --epochs $(ALIGN_EPOCHS) --lr $(PRETRAIN_LR) \
	  $(PRETRAIN_SLURM)
	$(OVPIPE) pretrain --recipe tiny --stage 1.5 --run-dir $(RUN) --steps $(PRETRAIN_STEPS) --lr $(PRETRAIN_LR) $(PRETRAIN_SLURM)
	$(OVPIPE) pretrain --recipe tiny --stage 2 --run-dir $(RUN) --steps $(INSTRUCT_STEPS) --lr $(PRETRAIN_LR) \
	  $(PRETRAIN_SLURM) $(PRETRAIN_WAIT)
	$(OVPIPE) export-model --run-dir $(RUN) --stage 2 --out $(HF_EXPORT)

export-model:
	$(OVPIPE) export-model --run-dir $(RUN) --stage 2 --out $(HF_EXPORT)
