# curation: demo CLIP (demo only) → image / concept embeddings → top-K concepts → near-duplicates + alignment
# → the faiss index and map layout (the viewer's search by meaning) → balance (skipping near_duplicate /
# low_alignment) → report
DEMO_TARGETS += curation
CLIP_CKPT = $(abspath $(RUN))/demo-clip/data/tiny-clip.pt
DEMO_CLIP_ARGS ?=

.PHONY: curation
curation:
	$(OVPIPE) demo-clip --config configs/demo/demo-clip.yaml --run-dir $(RUN) \
	  --set ground_truth=$(abspath $(DEMO_DATA))/ground_truth.parquet --set vocabulary=$(abspath $(DEMO_DATA))/concepts.txt $(DEMO_CLIP_ARGS)
	$(OVPIPE) embed-images --config configs/demo/embed-images.yaml --set pretrained=$(CLIP_CKPT) $(STEP_ARGS)
	$(OVPIPE) embed-concepts --config configs/demo/embed-concepts.yaml --set pretrained=$(CLIP_CKPT) \
	  --set vocabulary=$(abspath $(DEMO_DATA))/concepts.txt $(STEP_ARGS)
	$(OVPIPE) assign --config configs/demo/assign.yaml $(STEP_ARGS)
	$(OVPIPE) dedup --config configs/demo/dedup.yaml --set planted=$(abspath $(DEMO_DATA))/planted.parquet $(STEP_ARGS)
	$(OVPIPE) align --config configs/demo/align.yaml --set planted=$(abspath $(DEMO_DATA))/planted.parquet $(STEP_ARGS)
	$(OVPIPE) index --config configs/demo/index.yaml $(STEP_ARGS)
	$(OVPIPE) balance --config configs/demo/balance.yaml $(STEP_ARGS)
	$(OVPIPE) balance-report --config configs/demo/balance-report.yaml $(EXEC_ARGS)
