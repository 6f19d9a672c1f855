# packing: tiny tokenizer (demo only) → lengths → pack, for caption data (stages 1, 1.5) and
# instruction data (stage 2, under --name lengths-instruct / pack-instruct). Both pack runs read
# curation's `balanced` copies when `balance` has run; the test is made when the recipe runs (not
# when make parses this file), so `make demo` — curation then packing in one make — picks it up.
DEMO_TARGETS += packing
PACK_COPIES = $$(test -d $(RUN)/balance/balanced && echo balanced || echo none)

.PHONY: packing
packing:
	$(BIN)/python -m packing.tiny_tokenizer --out $(abspath $(RUN))/tokenizer --run-dir $(RUN)
	$(OVPIPE) lengths --config configs/demo/lengths.yaml --set tokenizer=$(abspath $(RUN))/tokenizer $(STEP_ARGS)
	$(OVPIPE) pack --config configs/demo/pack.yaml --set copies_from=$(PACK_COPIES) $(STEP_ARGS)
	$(OVPIPE) lengths --name lengths-instruct --config configs/demo/lengths.yaml \
	  --set tokenizer=$(abspath $(RUN))/tokenizer --set template=instruct $(STEP_ARGS)
	$(OVPIPE) pack --name pack-instruct --config configs/demo/pack.yaml --set lengths_step=lengths-instruct \
	  --set copies_from=$(PACK_COPIES) $(STEP_ARGS)
