# bench-scale: the scale dry run (bench/bench_scale.py, docs/scale_bench.md) — balance → lengths → pack through
# the local executor (8 tasks, 2 workers) with per-task peak memory, then the cluster cost projection.
#   1. the whole chain (lengths tokenising for real) at SCALE_CHAIN samples, + the ViT-H-14 CPU timing;
#   2. balance → pack at SCALE_SAMPLES, the lengths manifest written from the synthetic draws. The lengths
#      step streams its slice and runs at these sizes too (`--samples 85M` runs the whole chain), but it
#      tokenises every caption (about 10 min at 85M on 2 cores), which this series leaves out.
# Outputs bench/results/bench_scale.{chain,scale}.json and the merged tables in bench/results/bench_scale.txt.
#   make bench-scale SCALE_SAMPLES='10M 20M 40M'
SCALE_CHAIN   ?= 1M
SCALE_SAMPLES ?= 10M 40M 85M
SCALE_ARGS    ?=
SCALE_WORK    ?= runs/bench-scale
SCALE_OUT     ?= bench/results/bench_scale

.PHONY: bench-scale
bench-scale: install
	$(BIN)/python -m bench.bench_scale --samples $(SCALE_CHAIN) --work $(SCALE_WORK) --json $(SCALE_OUT).chain.json $(SCALE_ARGS)
	$(BIN)/python -m bench.bench_scale --samples $(SCALE_SAMPLES) --steps balance pack --no-vit --work $(SCALE_WORK) \
	  --json $(SCALE_OUT).scale.json $(SCALE_ARGS)
	$(BIN)/python -m bench.bench_scale --report $(SCALE_OUT).chain.json $(SCALE_OUT).scale.json > $(SCALE_OUT).txt
