# packing: tiny tokenizer (demo only) → lengths → pack, once per training stage's data:
#   lengths / pack                  web captions, weighted by curation's `balanced` copies  (stage 1.5)
#   lengths-align / pack-align      the LLaVA-558K-style caption conversations               (stage 1)
#   mix → lengths-instruct / pack-instruct   instruction conversations drawn to category
#                                   proportions from LLaVA JSON + FineVision                 (stage 2)
# Both caption runs read curation's `balanced` copies when `balance` has run; the test is made when the
# recipe runs (not when make parses this file), so `make demo` — curation then packing — picks it up.
DEMO_TARGETS += packing
PACK_COPIES = $$(test -d $(RUN)/balance/balanced && echo balanced || echo none)
TOKENIZER = $(abspath $(RUN))/tokenizer

.PHONY: packing
packing:
	$(BIN)/python -m packing.tiny_tokenizer --out $(TOKENIZER) --run-dir $(RUN)
	$(OVPIPE) lengths --config configs/demo/lengths.yaml --set tokenizer=$(TOKENIZER) $(STEP_ARGS)
	$(OVPIPE) pack --config configs/demo/pack.yaml --set copies_from=$(PACK_COPIES) $(STEP_ARGS)
	$(OVPIPE) lengths --name lengths-align --config configs/demo/lengths.yaml --set tokenizer=$(TOKENIZER) \
	  --set 'samples_steps=[ingest-llava]' $(STEP_ARGS)
	$(OVPIPE) pack --name pack-align --config configs/demo/pack.yaml --set lengths_step=lengths-align $(STEP_ARGS)
	$(OVPIPE) mix --config configs/demo/mix.yaml $(STEP_ARGS)
	$(OVPIPE) lengths --name lengths-instruct --config configs/demo/lengths.yaml --set tokenizer=$(TOKENIZER) \
	  --set 'samples_steps=[ingest-instruct]' $(STEP_ARGS)
	$(OVPIPE) pack --name pack-instruct --config configs/demo/pack.yaml --set lengths_step=lengths-instruct \
	  --set copies_from=mixed $(STEP_ARGS)
	$(OVPIPE) sql $(RUN) "SELECT category, n_images, count(*) AS samples, round(avg(total_tokens), 1) AS mean_tokens FROM lengths JOIN samples USING (sample_id) GROUP BY ALL ORDER BY ALL"

# official: the stage-1.5 packs in the official trainer's layout (pack-official), and that folder read back as
# ovpipe packs (import-packs) — the drop-in both ways (docs/official.md). A target of its own, after packing.
DEMO_TARGETS += official
.PHONY: official
official:
	$(OVPIPE) pack-official --set pack_step=pack $(STEP_ARGS)
	$(OVPIPE) import-packs --config configs/demo/import-packs.yaml --set source=$(abspath $(RUN))/pack-official \
	  --set tokenizer=$(TOKENIZER) $(STEP_ARGS)
