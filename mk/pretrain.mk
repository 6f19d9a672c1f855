# pretrain: stages 1 → 1.5 → 2 of the `tiny` recipe on the demo's packed shards (caption packs for
# 1 and 1.5, instruction packs for 2), a few dozen steps each on the CPU.
DEMO_TARGETS += pretrain
PRETRAIN_STEPS ?= 30
PRETRAIN_LR ?= 3e-3

.PHONY: pretrain
pretrain:
	$(OVPIPE) pretrain --recipe tiny --stage 1 --run-dir $(RUN) --steps $(PRETRAIN_STEPS) --lr $(PRETRAIN_LR)
	$(OVPIPE) pretrain --recipe tiny --stage 1.5 --run-dir $(RUN) --steps $(PRETRAIN_STEPS) --lr $(PRETRAIN_LR)
	$(OVPIPE) pretrain --recipe tiny --stage 2 --run-dir $(RUN) --steps $(PRETRAIN_STEPS) --lr $(PRETRAIN_LR)
