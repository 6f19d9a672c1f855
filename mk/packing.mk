# packing: tiny tokenizer (demo only) → lengths → pack, for caption data (stages 1, 1.5) and
# instruction data (stage 2, under --name lengths-instruct / pack-instruct).
DEMO_TARGETS += packing
PACK_COPIES ?= $(if $(wildcard $(RUN)/balance/balanced),balanced,none)

.PHONY: packing
packing:
	$(BIN)/python -m packing.tiny_tokenizer --out $(abspath $(RUN))/tokenizer --run-dir $(RUN)
	$(OVPIPE) lengths --config configs/demo/lengths.yaml --set tokenizer=$(abspath $(RUN))/tokenizer $(STEP_ARGS)
	$(OVPIPE) pack --config configs/demo/pack.yaml --set copies_from=$(PACK_COPIES) $(STEP_ARGS)
	$(OVPIPE) lengths --name lengths-instruct --config configs/demo/lengths.yaml \
	  --set tokenizer=$(abspath $(RUN))/tokenizer --set template=instruct $(STEP_ARGS)
	$(OVPIPE) pack --name pack-instruct --config configs/demo/pack.yaml --set lengths_step=lengths-instruct $(STEP_ARGS)
