# rl: demo prompt set → rl-ingest → rollouts of the demo's own exported stage-2 VLM (VLM_MODEL, mk/recaption.mk),
# generating for real on the CPU with the prompt images through its processor → score → select → export.
# The prompts ask the answer-only skills stage 2 taught (demo/rl.py); the held-out source is measured by
# `select` and never kept (configs/demo/select.yaml held_out_sources), so it never reaches the export.
# Then the loop closed: `grpo` trains the model on the export's splits (configs/demo/grpo.yaml); rollout, score and
# select run again on the trained model (-grpo) and on the start model (-base), both with fresh rollout seeds
# (LOOP_SEED): the first selection's pass@1 of its kept prompts is biased upward (they were kept because they
# happened to score), so before/after compares two fresh draws. `ovpipe summary` prints pass@1 before and after,
# on the trained prompts and on the held-out ones. On Slurm, grpo is one job (srun, one CPU rank here).
LOOP_SEED ?= 1
# RL_LOOP=0 stops after the export (tests/ovpipe/test_slurm_demo.py: grpo on Slurm is tests/grpo/test_grpo_slurm.py's)
RL_LOOP ?= 1
DEMO_TARGETS += rl
GRPO_ARGS = --run-dir $(RUN) --executor $(EXECUTOR) $(if $(filter slurm,$(EXECUTOR)),$(SLURM_WAIT) --nodes 1 --gpus-per-node 0)
RL_DATA = $(abspath $(RUN))/rl-data

.PHONY: rl
rl:
	$(BIN)/python -m demo.rl prompts --out $(RL_DATA)
	$(OVPIPE) rl-ingest --config configs/demo/rl-ingest.yaml --set 'inputs=["$(RL_DATA)/prompts.parquet"]' $(STEP_ARGS)
	$(OVPIPE) rollout --config configs/demo/rollout.yaml --set model=$(DEMO_VLM) $(STEP_ARGS)
	$(OVPIPE) score --config configs/demo/score.yaml $(STEP_ARGS)
	$(OVPIPE) select --config configs/demo/select.yaml $(STEP_ARGS)
	$(OVPIPE) export --config configs/demo/export.yaml $(EXEC_ARGS)
	@stages=$$($(BIN)/python -m demo.rl grpo-stages --run-dir $(RUN)); \
	if [ "$(RL_LOOP)" = 0 ]; then echo "grpo: RL_LOOP=0, the loop is not run"; elif [ -z "$$stages" ]; then echo "grpo: the export wrote no split (no prompt kept): the loop is not run"; else \
	$(OVPIPE) grpo --config configs/demo/grpo.yaml --set model=$(DEMO_VLM) --set "stages=$$stages" $(GRPO_ARGS) && \
	for side in base:$(DEMO_VLM) grpo:$(abspath $(RUN))/grpo/model; do n=$${side%%:*}; \
	  $(OVPIPE) rollout --name rollout-$$n --config configs/demo/rollout.yaml --set model=$${side#*:} \
	    --set seed=$(LOOP_SEED) $(STEP_ARGS) && \
	  $(OVPIPE) score --name score-$$n --config configs/demo/score.yaml --set rollouts_step=rollout-$$n $(STEP_ARGS) && \
	  $(OVPIPE) select --name select-$$n --config configs/demo/select.yaml --set rewards_step=score-$$n \
	    --set rollouts_step=rollout-$$n $(STEP_ARGS) || exit 1; done; fi
