# rl: demo prompt set → rl-ingest → rollouts of the demo's own exported stage-2 VLM (VLM_MODEL, mk/recaption.mk),
# generating for real on the CPU with the prompt images through its processor → score → select → export.
# The prompts ask the answer-only skills stage 2 taught (demo/rl.py); the held-out source is measured by
# `select` and never kept (configs/demo/select.yaml held_out_sources), so it never reaches the export.
DEMO_TARGETS += rl
RL_DATA = $(abspath $(RUN))/rl-data

.PHONY: rl
rl:
	$(BIN)/python -m demo.rl prompts --out $(RL_DATA)
	$(OVPIPE) rl-ingest --config configs/demo/rl-ingest.yaml --set 'inputs=["$(RL_DATA)/prompts.parquet"]' $(STEP_ARGS)
	$(OVPIPE) rollout --config configs/demo/rollout.yaml --set model=$(DEMO_VLM) $(STEP_ARGS)
	$(OVPIPE) score --config configs/demo/score.yaml $(STEP_ARGS)
	$(OVPIPE) select --config configs/demo/select.yaml $(STEP_ARGS)
	$(OVPIPE) export --config configs/demo/export.yaml $(EXEC_ARGS)
