# ovpipe — `make demo` then `make test` on a fresh machine.
# Python 3.12 is required by megatron-core >= 0.17. PYTHON312 is the first of these that runs and is 3.12:
# python3.12 on PATH (a pyenv shim there fails unless a 3.12 is selected, hence the check that it runs),
# `pyenv prefix 3.12`, the newest 3.12.x under $PYENV_ROOT (default ~/.pyenv)/versions, python3. Looked for
# once, and only by a recipe that needs it (creating .uv or .venv); `make PYTHON312=/path/to/python3.12`
# skips the search. None found: the recipe stops with one line saying so (NEED_PYTHON312).
PY312_CHECK := -c 'import sys; assert sys.version_info[:2] == (3, 12)'
PY312_SEARCH = for c in "$$(command -v python3.12)" "$$(pyenv prefix 3.12 2>/dev/null | head -n1)/bin/python3.12" \
  $$(ls -d "$(or $(PYENV_ROOT),$(HOME)/.pyenv)"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -rV) \
  "$$(command -v python3)"; do [ -x "$$c" ] && "$$c" $(PY312_CHECK) 2>/dev/null && { echo "$$c"; break; }; done
PYTHON312 ?= $(eval PYTHON312 := $(shell $(PY312_SEARCH)))$(PYTHON312)
NEED_PYTHON312 = @test -n "$(PYTHON312)" && "$(PYTHON312)" $(PY312_CHECK) 2>/dev/null || { echo "ovpipe needs \
  Python 3.12: $(if $(PYTHON312),PYTHON312=$(PYTHON312) is not a working Python 3.12,none found on PATH or in \
  pyenv); install it or pass PYTHON312=/path/to/python3.12" >&2; exit 1; }
VENV      := .venv
BIN       := $(VENV)/bin
OVPIPE    := $(BIN)/ovpipe
RUN       ?= runs/demo
DEMO_DATA ?= runs/demo-data
BENCH_ARGS ?=
TASKS     ?= 2
WORKERS   ?= 2
EXECUTOR  ?= local
# On Slurm each step blocks until its own job chain has finished (--wait), so the next command of a
# target — a step, an in-process helper, a query — finds its outputs (docs/slurm.md).
SLURM_WAIT ?= --wait
# A site's own sbatch flags for every step's jobs, e.g. SLURM_ARGS="--account=lab --qos=normal --partition=cpu"
SLURM_ARGS ?=
EXEC_ARGS  = --run-dir $(RUN) --executor $(EXECUTOR) $(if $(filter slurm,$(EXECUTOR)),$(SLURM_WAIT) $(SLURM_ARGS))
STEP_ARGS  = $(EXEC_ARGS) --tasks $(TASKS) --workers $(WORKERS)
DEMO_DATA_ARGS ?=

.PHONY: install install-layout bytecode lock test-latest demo test test-slurm-demo test-fast bench demo-data ingest report status clean

# The install is the lock (requirements/lock.txt, every package pinned with hashes for CPython 3.12 on
# x86-64 Linux), made by uv from pyproject.toml's ranges; `make lock` refreshes it (docs/install.md).
UV_VERSION := 0.13.9
UV         := .uv/bin/uv
LOCK       := requirements/lock.txt
LOCK_ARGS  := --python-version 3.12 --python-platform x86_64-manylinux_2_28 --generate-hashes --no-header -q

$(UV):
	$(NEED_PYTHON312)
	PIP_CONFIG_FILE=/dev/null $(PYTHON312) -m pip install -q --disable-pip-version-check --root-user-action=ignore \
	  --target .uv uv==$(UV_VERSION)

# --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines and CI), Python
# never caches what it compiles, so every process — each step, each task, each test's subprocess — would
# recompile torch's, transformers' and megatron's sources: ~9 s of CPU per process. Compiled once here,
# read by every process after (`make bytecode` does the same for the project's own packages).
install: $(VENV)/.installed
$(VENV)/.installed: $(LOCK) requirements/no-deps.txt pyproject.toml | $(UV)
	$(if $(wildcard $(BIN)/python),,$(NEED_PYTHON312))
	test -x $(BIN)/python || $(UV) venv -q --seed --python $(PYTHON312) $(VENV)
	$(UV) pip sync -q --compile-bytecode --python $(BIN)/python --require-hashes $(LOCK)
	$(UV) pip install -q --compile-bytecode --python $(BIN)/python --no-deps --require-hashes -r requirements/no-deps.txt
	$(UV) pip install -q --python $(BIN)/python --no-deps -e .
	$(BIN)/python -W ignore -c "import logging; logging.disable(logging.WARNING); import torchvision, open_clip, megatron.core, faiss, transformers; print('install ok: torch', __import__('torch').__version__, '| transformers', transformers.__version__, '| megatron-core', megatron.core.__version__)"
	touch $@

# UMAP and openTSNE for bench/bench_layout.py only, on top of the install (requirements/layout.txt: the lock's
# versions plus theirs); `make install` drops them again.
install-layout: install
	$(UV) pip install -q --compile-bytecode --python $(BIN)/python --require-hashes -r requirements/layout.txt

# The project's own packages, compiled where their sources changed (the install's note above says why).
PROJECT_PKGS := ovpipe manifests curation packing pretrain rl_select inference grpo demo viewer
bytecode: install
	@$(BIN)/python -m compileall -q -j 0 $(PROJECT_PKGS) >/dev/null

# Re-resolve every lock from pyproject.toml's ranges (and requirements/*.in). To upgrade one package
# only: make lock LOCK_UPGRADE="--upgrade-package transformers", then make test.
LOCK_UPGRADE ?=
lock: | $(UV)
	$(UV) pip compile pyproject.toml --extra all $(LOCK_ARGS) $(LOCK_UPGRADE) -o $(LOCK)
	$(UV) pip compile requirements/no-deps.in --no-deps $(LOCK_ARGS) -o requirements/no-deps.txt
	$(UV) pip compile pyproject.toml --extra layout -c $(LOCK) $(LOCK_ARGS) -o requirements/layout.txt
	$(UV) pip compile requirements/trainers.in --no-deps $(LOCK_ARGS) -o requirements/trainers.txt
	$(UV) pip compile requirements/lmms-eval.in --no-deps $(LOCK_ARGS) -o requirements/lmms-eval.txt

# The canary: the newest releases pyproject.toml's ranges allow, in a throwaway venv outside .venv; runs
# the suite there and prints what differs from the lock. Not part of CI.
LATEST_VENV ?= /tmp/ovpipe-latest
test-latest: | $(UV)
	$(NEED_PYTHON312)
	rm -rf $(LATEST_VENV) && $(UV) venv -q --seed --python $(PYTHON312) $(LATEST_VENV)
	$(UV) pip install -q --python $(LATEST_VENV)/bin/python --upgrade -e '.[all]'
	$(UV) pip install -q --python $(LATEST_VENV)/bin/python --no-deps -r requirements/no-deps.txt
	$(LATEST_VENV)/bin/python scripts/lock_diff.py $(LOCK) $(LATEST_VENV)/bin/python
	$(LATEST_VENV)/bin/python -m pytest -q -p no:cacheprovider

demo-data: install
	$(OVPIPE) demo-data --out $(DEMO_DATA) $(DEMO_DATA_ARGS)

# Three sources, three ingest steps: the web caption shards (curated and balanced for stage 1.5), the
# LLaVA-558K-style alignment set (stage 1), and the instruction set (LLaVA JSON + FineVision Parquet, stage 2).
ingest: demo-data
	$(OVPIPE) ingest --config configs/demo/ingest.yaml --set 'inputs=["$(DEMO_DATA)/shards/*.tar"]' $(STEP_ARGS)
	$(OVPIPE) ingest --name ingest-llava --config configs/demo/ingest-llava.yaml \
	  --set 'inputs=["$(DEMO_DATA)/llava-558k/*.json"]' $(STEP_ARGS)
	$(OVPIPE) ingest --name ingest-instruct --config configs/demo/ingest-instruct.yaml \
	  --set 'inputs=["$(DEMO_DATA)/instruct/llava/*.json", "$(DEMO_DATA)/instruct/finevision/*.parquet"]' $(STEP_ARGS)

# Stage targets (curation, packing, pretrain, rl) live in mk/<stage>.mk; the loopback Slurm cluster
# (slurm-up, slurm-down, slurm-demo) in mk/slurm.mk.
-include mk/*.mk

DEMO_ORDER  := curation packing official pretrain recaption rl gym
DEMO_STAGES ?= ingest $(filter $(DEMO_TARGETS),$(DEMO_ORDER))
# The demo's terminal shows each step's progress and one summary line; third-party warnings go to the
# task logs (make demo VERBOSE=1 shows everything). The output is teed to RUN/demo-output.log and
# checked (scripts/check_demo_output.py): no warnings or tracebacks, a summary line for every step.
VERBOSE ?=
demo: bytecode
	@mkdir -p $(RUN)
	@bash -o pipefail -c '$(if $(VERBOSE),OVPIPE_VERBOSE=1 )$(MAKE) --no-print-directory $(if $(VERBOSE),,-s) $(DEMO_STAGES) 2>&1 | tee $(RUN)/demo-output.log'
	@$(if $(VERBOSE),true,$(BIN)/python scripts/check_demo_output.py $(RUN)/demo-output.log $(RUN))
	@$(OVPIPE) summary $(RUN)
	@echo "Look at the run in a browser: make view (ovpipe view $(RUN)), then open http://127.0.0.1:$(VIEW_PORT)/ — the embedding map is at http://127.0.0.1:$(VIEW_PORT)/map"

# The viewer over the run (docs/view.md): a read-only page on this machine only (127.0.0.1); Ctrl-C stops it.
VIEW_PORT ?= 8765
.PHONY: view
view: install
	$(OVPIPE) view $(RUN) --port $(VIEW_PORT)

report:
	$(OVPIPE) report $(RUN)

status:
	$(OVPIPE) status $(RUN)

# Two pytest workers (pytest-xdist): most tests keep one core busy, so two cut the wall time on the 2-core CI
# machine. --dist loadscope keeps each module on one worker (its module fixtures, such as a Slurm module's loopback
# cluster, made once), in the order tests/conftest.py sorts them (hence --no-loadscope-reorder: xdist would
# otherwise start the modules with the most tests first). TEST_WORKERS=0 runs serially, TEST_WORKERS=3 adds a
# worker (docs/install.md has the timings). PYTEST_ARGS adds to either target: make test-fast
# PYTEST_ARGS="--durations=40", PYTEST_ARGS=tests/packing.
TEST_WORKERS ?= 2
TEST_XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)
# test-fast's tests are small and their module fixtures cheap: test by test (--dist load) balances the two workers
# better than module by module (90.8 s against 97.8 s from a clean clone at 700dabd)
TEST_XDIST_FAST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist load)
PYTEST_ARGS ?=
# make test: the whole suite, the Slurm tests included where Slurm is installed (under CI=true, they and the
# browser test fail where what they need is missing; tests/conftest.py NEEDS) — all but the Makefile-on-Slurm
# drill, which is `make test-slurm-demo`: the demo's curation, packing and RL targets run twice, on the loopback
# cluster and locally, ~300 CPU-s of the 2-core machine's ~1,300 (a quarter of the suite in one test), so
# `make test` stays under 10 minutes there. .ci/run runs both.
SLURM_DEMO_TEST = tests/ovpipe/test_slurm_demo.py
test: bytecode
	$(BIN)/python -m pytest -q $(TEST_XDIST) --ignore=$(SLURM_DEMO_TEST) $(PYTEST_ARGS)

# make test-slurm-demo: the Makefile on Slurm, byte for byte against the local run (~3 min on 2 cores)
test-slurm-demo: bytecode
	$(BIN)/python -m pytest -q $(SLURM_DEMO_TEST) $(PYTEST_ARGS)

# make test-fast: the unit tests, to run between edits (docs/install.md: under 90 s on the 2-core machine). It
# leaves out the tests marked `slow` — the end-to-end drills (curation demo, RL pipeline, pretrain
# training / resume / kill / export / parallel-parity runs, the trainers' adapters against installed
# trainers) and every test over ~4 s, such as the memory-scale and byte-identity-at-any-task-count
# checks (listed in tests/conftest.py SLOW) — and the `slurm` tests (a loopback cluster per module).
test-fast: bytecode
	$(BIN)/python -m pytest -q $(TEST_XDIST_FAST) -m "not slow and not slurm" $(PYTEST_ARGS)

bench: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench $(BENCH_ARGS)

clean:
	rm -rf runs .pytest_cache
