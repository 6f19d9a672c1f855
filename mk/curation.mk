# curation: demo CLIP (demo only) → image / concept embeddings → top-K concepts → near-duplicates + alignment
# → balance (skipping near_duplicate / low_alignment) → report
DEMO_TARGETS += curation
CLIP_CKPT = $(abspath $(RUN))/demo-clip/data/tiny-clip.pt
DEMO_CLIP_ARGS ?=
# DEDUP=off leaves out dedup and align, and balance reads neither: the Makefile-on-Slurm test
# (tests/ovpipe/test_slurm_demo.py) does, as both steps have Slurm tests of their own (test_dedup_slurm.py)
DEDUP ?= on
WITH_DEDUP = $(filter on,$(DEDUP))

.PHONY: curation
curation:
	$(OVPIPE) demo-clip --config configs/demo/demo-clip.yaml --run-dir $(RUN) \
	  --set ground_truth=$(abspath $(DEMO_DATA))/ground_truth.parquet --set vocabulary=$(abspath $(DEMO_DATA))/concepts.txt $(DEMO_CLIP_ARGS)
	$(OVPIPE) embed-images --config configs/demo/embed-images.yaml --set pretrained=$(CLIP_CKPT) $(STEP_ARGS)
	$(OVPIPE) embed-concepts --config configs/demo/embed-concepts.yaml --set pretrained=$(CLIP_CKPT) \
	  --set vocabulary=$(abspath $(DEMO_DATA))/concepts.txt $(STEP_ARGS)
	$(OVPIPE) assign --config configs/demo/assign.yaml $(STEP_ARGS)
	$(if $(WITH_DEDUP),$(OVPIPE) dedup --config configs/demo/dedup.yaml --set planted=$(abspath $(DEMO_DATA))/planted.parquet $(STEP_ARGS))
	$(if $(WITH_DEDUP),$(OVPIPE) align --config configs/demo/align.yaml --set planted=$(abspath $(DEMO_DATA))/planted.parquet $(STEP_ARGS))
	$(OVPIPE) balance --config configs/demo/balance.yaml $(if $(WITH_DEDUP),,--set dedup_step='""' --set alignment_step='""') $(STEP_ARGS)
	$(OVPIPE) balance-report --config configs/demo/balance-report.yaml $(EXEC_ARGS)
