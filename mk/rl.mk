# rl: demo prompt set → rl-ingest → rollouts (the demo's own exported stage-2 VLM generating for real on
# the CPU with the prompt images through its processor — VLM_MODEL, mk/recaption.mk; and a simulated
# policy imported through the `file` backend for the selection rules) → score → select → export
DEMO_TARGETS += rl
RL_DATA = $(abspath $(RUN))/rl-data

.PHONY: rl
rl:
	$(BIN)/python -m demo.rl prompts --out $(RL_DATA)
	$(OVPIPE) rl-ingest --config configs/demo/rl-ingest.yaml --set 'inputs=["$(RL_DATA)/prompts.parquet"]' $(STEP_ARGS)
	$(OVPIPE) rollout --name rollout-vlm --config configs/demo/rollout.yaml --set model=$(DEMO_VLM) $(STEP_ARGS)
	$(BIN)/python -m demo.rl simulate --run-dir $(RUN) --out $(RL_DATA)/rollouts.jsonl --n 8
	$(OVPIPE) rollout --config configs/demo/rollout.yaml --set backend=file --set file=$(RL_DATA)/rollouts.jsonl \
	  --set model=simulated-policy --set n=8 --set 'prompt_types=[answer_only, thinking]' $(STEP_ARGS)
	$(OVPIPE) score --config configs/demo/score.yaml $(STEP_ARGS)
	$(OVPIPE) select --config configs/demo/select.yaml $(STEP_ARGS)
	$(OVPIPE) export --config configs/demo/export.yaml $(EXEC_ARGS)
