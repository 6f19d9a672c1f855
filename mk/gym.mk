# gym: a few game states per VLM-Gym game as rl_prompts (one run folder per game, so rollout /
# score / select / export can run on each exactly as on benchmark data)
DEMO_TARGETS += gym
GYM_GAMES ?= 2048 shisen-sho shisen-sho-pictures swap

.PHONY: gym
gym:
	for g in $(GYM_GAMES); do \
	  $(OVPIPE) rl-gym --config configs/demo/rl-gym.yaml --set game=$$g --run-dir $(RUN)/gym/$$g || exit 1; \
	done
	$(OVPIPE) sql $(RUN)/gym/2048 "SELECT answer_type, status, count(*) FROM rl_prompts GROUP BY ALL"
