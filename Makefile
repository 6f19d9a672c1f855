# ovpipe — `make demo` then `make test` on a fresh machine.
# Python 3.12 is required by megatron-core >= 0.17; pyenv's 3.12 is on every machine here.
PYTHON312 ?= $(shell command -v /root/.pyenv/versions/3.12.1/bin/python3.12 || command -v python3.12)
VENV      := .venv
BIN       := $(VENV)/bin
OVPIPE    := $(BIN)/ovpipe
RUN       ?= runs/demo
DEMO_DATA ?= runs/demo-data
BENCH_ARGS ?=
TASKS     ?= 2
WORKERS   ?= 2
EXECUTOR  ?= local
STEP_ARGS  = --run-dir $(RUN) --executor $(EXECUTOR) --tasks $(TASKS) --workers $(WORKERS)

.PHONY: install demo test test-fast bench demo-data ingest report status clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON312) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all]'
	$(BIN)/pip install -q --no-deps lmms-engine==0.1.4   # the official LLaVA-OV-1.5 modeling files (docs/hf_format.md)
	$(BIN)/python -W ignore -c "import torchvision, open_clip, megatron.core, faiss, transformers; print('install ok: torch', __import__('torch').__version__, '| torchvision', torchvision.__version__, '| megatron-core', megatron.core.__version__)"
	touch $@

demo-data: install
	$(OVPIPE) demo-data --out $(DEMO_DATA)

# Three sources, three ingest steps: the web caption shards (curated and balanced for stage 1.5), the
# LLaVA-558K-style alignment set (stage 1), and the instruction set (LLaVA JSON + FineVision Parquet, stage 2).
ingest: demo-data
	$(OVPIPE) ingest --config configs/demo/ingest.yaml --set 'inputs=["$(DEMO_DATA)/shards/*.tar"]' $(STEP_ARGS)
	$(OVPIPE) ingest --name ingest-llava --config configs/demo/ingest-llava.yaml \
	  --set 'inputs=["$(DEMO_DATA)/llava-558k/*.json"]' $(STEP_ARGS)
	$(OVPIPE) ingest --name ingest-instruct --config configs/demo/ingest-instruct.yaml \
	  --set 'inputs=["$(DEMO_DATA)/instruct/llava/*.json", "$(DEMO_DATA)/instruct/finevision/*.parquet"]' $(STEP_ARGS)

# Stage targets (curation, packing, pretrain, rl) live in mk/<stage>.mk.
-include mk/*.mk

DEMO_ORDER  := curation packing pretrain recaption rl gym
DEMO_STAGES ?= ingest $(filter $(DEMO_TARGETS),$(DEMO_ORDER))
demo: install
	$(MAKE) --no-print-directory $(DEMO_STAGES)
	$(OVPIPE) report $(RUN)
	@echo "demo run folder: $(abspath $(RUN))   (query it: $(OVPIPE) sql $(RUN) \"SELECT status, count(*) FROM samples GROUP BY 1\")"

report:
	$(OVPIPE) report $(RUN)

status:
	$(OVPIPE) status $(RUN)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not slurm"

bench: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench $(BENCH_ARGS)

clean:
	rm -rf runs .pytest_cache
