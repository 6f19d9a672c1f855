# gym: G1's random-walk states of the four VLM-Gym games, one rl-gym step (multi-game), as rl_prompts that
# rollout / score / select / export / grpo read exactly as benchmark data
DEMO_TARGETS += gym

.PHONY: gym
gym:
	$(OVPIPE) rl-gym --config configs/demo/rl-gym.yaml --run-dir $(RUN)/gym
	$(OVPIPE) sql $(RUN)/gym "SELECT answer_type, status, count(*) FROM rl_prompts GROUP BY ALL ORDER BY ALL"
