# eval: lmms-eval (its own CLI and transformers 4.57, installed from requirements/lmms-eval.txt into a cache
# folder outside the venv) over the demo's exported stage-2 folder (HF_EXPORT, mk/pretrain.mk) and the demo's
# local image-QA task (DEMO_DATA/eval-tasks, written by demo-data) → RUN/eval/eval/, shown by `make report`.
# Not part of `make demo`: the first run pip-installs lmms-eval from the registry (docs/eval.md). --overwrite:
# the model is a path, not a manifest the run folder tracks, so a re-exported folder must be scored again.
EVAL_TASKS ?= $(abspath $(DEMO_DATA))/eval-tasks
EVAL_ARGS ?=

.PHONY: eval
eval: install
	$(OVPIPE) eval --set model=$(abspath $(HF_EXPORT)) --set tasks_dir=$(EVAL_TASKS) $(EVAL_ARGS) --run-dir $(RUN) --overwrite
	$(OVPIPE) sql $(RUN) "SELECT task, metric, value, n_samples, status FROM eval ORDER BY task, metric"
