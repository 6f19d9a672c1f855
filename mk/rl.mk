# rl: demo prompt set → rl-ingest → rollouts (a tiny random LM generating for real on the CPU, and a
# simulated policy imported through the `file` backend) → score → select → export
DEMO_TARGETS += rl
RL_DATA = $(abspath $(RUN))/rl-data

.PHONY: rl
rl:
	$(BIN)/python -m rl_select.demo prompts --out $(RL_DATA)
	$(BIN)/python -m rl_select.demo tiny-model --out $(RL_DATA)/tiny-lm
	$(OVPIPE) rl-ingest --config configs/demo/rl-ingest.yaml --set 'inputs=["$(RL_DATA)/prompts.parquet"]' $(STEP_ARGS)
	$(OVPIPE) rollout --name rollout-tiny --config configs/demo/rollout.yaml --set model=$(RL_DATA)/tiny-lm $(STEP_ARGS)
	$(BIN)/python -m rl_select.demo simulate --run-dir $(RUN) --out $(RL_DATA)/rollouts.jsonl --n 8
	$(OVPIPE) rollout --config configs/demo/rollout.yaml --set backend=file --set file=$(RL_DATA)/rollouts.jsonl \
	  --set model=simulated-policy --set n=8 --set 'prompt_types=[answer_only, thinking]' $(STEP_ARGS)
	$(OVPIPE) score --config configs/demo/score.yaml $(STEP_ARGS)
	$(OVPIPE) select --config configs/demo/select.yaml $(STEP_ARGS)
	$(OVPIPE) export --config configs/demo/export.yaml --run-dir $(RUN)
