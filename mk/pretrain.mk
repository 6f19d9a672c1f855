# pretrain (work in progress): the LLM side of stages 1.5 and 2 of the `tiny` recipe on the demo's
# packed shards (caption packs, then instruction packs), a few dozen steps each on the CPU.
DEMO_TARGETS += pretrain
PRETRAIN_STEPS ?= 30

.PHONY: pretrain
pretrain:
	$(OVPIPE) pretrain --recipe tiny --stage 1.5 --run-dir $(RUN) --steps $(PRETRAIN_STEPS)
	$(OVPIPE) pretrain --recipe tiny --stage 2 --run-dir $(RUN) --steps $(PRETRAIN_STEPS)
