-- requires: rewards
-- Rewards by type and status: timeouts and errors are rows, not crashes.
SELECT folder, reward_type, status, count(*) AS rows, round(avg(reward), 3) AS mean_reward, any_value(error) AS example_error
FROM rewards GROUP BY ALL ORDER BY folder, reward_type, status
