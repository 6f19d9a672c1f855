from grpo.sortedrl import Entry, SortedRLController, sample_lengths, simulate_baseline, simulate_sorted


def test_controller_lifecycle_and_grouped_loading():
    ctl = SortedRLController(batch_size=2, mode="partial")
    ctl.load_group([Entry(i, 10 * (i + 1)) for i in range(4)])
    assert not ctl.needs_group()
    started = ctl.schedule(3)
    assert [e.state for e in started] == ["running"] * 3
    for e in started:
        ctl.on_step(e, 10, logprobs=[-0.1] * 10)
    ctl.on_finish(started[0])
    assert ctl.ready_batch() is None
    ctl.on_finish(started[1])
    batch = ctl.ready_batch()
    assert [e.prompt_id for e in batch] == [0, 1] and all(e.state == "consumed" for e in batch)
    stopped = ctl.end_update()
    assert [e.prompt_id for e in stopped] == [2] and stopped[0].state == "paused"
    assert stopped[0].tokens == 10 and len(stopped[0].logprobs) == 10   # partial trajectory kept
    nxt = ctl.schedule(4)
    assert [e.prompt_id for e in nxt] == [2, 3]                         # paused partials first


def test_on_policy_discards_partials():
    ctl = SortedRLController(batch_size=1, mode="on_policy")
    ctl.load_group([Entry(0, 5), Entry(1, 50)])
    a, b = ctl.schedule(2)
    ctl.on_step(a, 5)
    ctl.on_step(b, 5)
    ctl.on_finish(a)
    ctl.ready_batch()
    ctl.end_update()
    assert b.state == "cached" and b.tokens == 0 and ctl.wasted_tokens == 5 and b.restarts == 1


def test_all_modes_train_every_token_and_sorted_rl_cuts_bubbles():
    lengths = sample_lengths(256, 4096, seed=1)
    base = simulate_baseline(lengths, 64, 64)
    on = simulate_sorted(lengths, 64, 64, "on_policy")
    part = simulate_sorted(lengths, 64, 64, "partial")
    for r in (base, on, part):
        assert r.trained_tokens == lengths.sum() and r.batches == 4
    assert on.bubble_ratio < base.bubble_ratio and part.bubble_ratio < base.bubble_ratio
    assert part.tokens_per_step > base.tokens_per_step and on.tokens_per_step > base.tokens_per_step
    assert part.wasted_tokens == 0 and on.wasted_tokens > 0
