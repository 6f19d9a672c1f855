"""Partial-mode SortedRL's behaviour weights inside ``OvpipeGRPOTrainer``: on a constructed batch whose rollouts hold
tokens of an earlier policy version, each stale token's weight is π_prox/π_behave (the policy's own log-prob against
the engine's), 0 above AReaL's cap of 5, and the loss is ``grpo.loss.decoupled_ppo_loss`` with those behaviour
log-probs; a batch of current-version tokens trains exactly as TRL's loss does."""
from __future__ import annotations

import math

import pytest
import torch

from demo.word_lm import word_lm


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig as TRLConfig

    from grpo.trainer import OvpipeGRPOTrainer

    folder = word_lm(tmp_path_factory.mktemp("lm") / "lm")
    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("out")), per_device_train_batch_size=4,
                     num_generations=2, max_completion_length=4, loss_type="dapo", beta=0.0, report_to=[],
                     use_cpu=True, logging_steps=1, save_strategy="no")
    tr = OvpipeGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(folder), args=args,
                             processing_class=AutoTokenizer.from_pretrained(folder),
                             reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                             train_dataset=Dataset.from_dict({"prompt": ["say yes", "say no"]}))
    tr.current_gradient_accumulation_steps = 1           # set by the HF Trainer's loop; one micro-step a step here
    return tr


def _batch(trainer):
    """4 rollouts, prompt of 3 tokens, completions of 4, 3, 4, 2 (right-padded), behaviour log-probs planted as
    the policy's own minus a known log-ratio per token; the policy's log-probs (π_prox) come from a plain forward."""
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    prompt = torch.randint(5, vocab, (4, 3), generator=g)
    completion = torch.randint(5, vocab, (4, 4), generator=g)
    cmask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    ids = torch.cat([prompt, completion], 1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=torch.cat([torch.ones_like(prompt), cmask], 1)).logits
    prox = torch.log_softmax(logits[:, 2:-1].float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    # rows 0 and 2 were resumed: their first tokens were sampled at version 3, the rest at 4 (the trained one)
    versions = [[3, 3, 4, 4], [4, 4, 4], [3, 4, 4, 4], [4, 4]]
    log_ratio = torch.tensor([[math.log(2.0), math.log(0.5), 0.0, 0.0],       # weights 2 and 0.5
                              [0.0, 0.0, 0.0, 0.0],
                              [math.log(10.0), 0.0, 0.0, 0.0],                  # 10 > 5: dropped
                              [0.0, 0.0, 0.0, 0.0]])
    behave = (prox - log_ratio) * cmask
    batch = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
             "completion_mask": cmask, "advantages": torch.tensor([1.5, -0.5, 2.0, -1.0]),
             "num_items_in_batch": cmask.sum(), "sampling_per_token_logps": behave}
    inputs = [{"token_versions": v, "trained_version": 4} for v in versions]
    return batch, inputs, prox, behave


def test_stale_tokens_carry_the_decoupled_weights_and_the_loss_is_its_definition(trainer):
    from grpo.loss import decoupled_ppo_loss

    batch, inputs, prox, behave = _batch(trainer)
    trainer.step_stats = {}
    trainer._add_behaviour_weights(batch, inputs)
    want = torch.ones(4, 4)
    want[0, 0], want[0, 1], want[2, 0] = 2.0, 0.5, 0.0
    assert torch.allclose(batch["behaviour_weights"], want, rtol=1e-3)   # π_prox: the trainer's own forward
    s = trainer.step_stats
    assert s["behave_stale_token_share"] == pytest.approx(3 / 13)
    assert s["behave_weight_mean"] == pytest.approx((2 + 0.5 + 0) / 3, rel=1e-3)
    assert s["behave_weight_max"] == pytest.approx(2.0, rel=1e-3) and s["behave_capped_share"] == pytest.approx(1 / 3)
    # the trainer's loss (TRL's dapo loss over w·A) equals grpo.loss's decoupled loss with the behaviour log-probs
    # of the stale tokens and the policy's own for the current ones (w = 1); θ = π_prox here, so the ratio is 1
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, batch)
    behave_eff = torch.where(torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).bool(),
                             behave, prox)
    ref, stats = decoupled_ppo_loss(prox, prox, behave_eff, batch["advantages"], batch["completion_mask"])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-4)
    # by hand: −Σ_t w_t·A_row / 13 tokens
    by_hand = -(1.5 * (2 + 0.5 + 1 + 1) - 0.5 * 3 + 2.0 * (0 + 1 + 1 + 1) - 1.0 * 2) / 13
    assert loss.item() == pytest.approx(by_hand, rel=1e-4) and stats["behave_capped_share"] == pytest.approx(1 / 13)


def test_current_version_tokens_train_exactly_as_trl(trainer):
    from trl import GRPOTrainer

    batch, inputs, _, _ = _batch(trainer)
    for inp in inputs:
        inp["token_versions"] = [4] * len(inp["token_versions"])
    trainer.step_stats = {}
    trainer._add_behaviour_weights(batch, inputs)
    assert "behaviour_weights" not in batch and trainer.step_stats == {"behave_stale_token_share": 0.0}
    trainer.model.train()
    torch.manual_seed(0)
    ours = trainer._compute_loss(trainer.model, batch)
    torch.manual_seed(0)
    trl = GRPOTrainer._compute_loss(trainer, trainer.model, batch)
    assert torch.equal(ours, trl)
    # plain GRPO (no rollout fields): nothing added either
    plain, _, _, _ = _batch(trainer)
    trainer._add_behaviour_weights(plain, [{} for _ in range(4)])
    assert "behaviour_weights" not in plain


def test_a_rollout_more_than_four_versions_stale_leaves_the_loss_and_its_denominator(trainer):
    """grpo.loss's staleness rule (η = 4): row 2 was admitted at version −1 (5 versions before the trained one, 4),
    so its tokens leave the completion mask and num_items_in_batch; row 0 (1 version old) is weighted as before,
    and the loss is decoupled_ppo_loss with the sample versions — its own rejection."""
    from grpo.loss import decoupled_ppo_loss

    batch, inputs, prox, behave = _batch(trainer)
    inputs[2]["token_versions"] = [-1, 4, 4, 4]
    trainer.step_stats = {}
    trainer._add_behaviour_weights(batch, inputs)
    assert batch["completion_mask"][2].sum() == 0 and batch["completion_mask"][[0, 1, 3]].sum() == 9
    assert int(batch["num_items_in_batch"]) == 9
    s = trainer.step_stats
    assert s["behave_rejected_stale_rollouts"] == 1 and s["behave_rejected_stale_tokens"] == 4
    assert s["behave_weight_mean"] == pytest.approx((2 + 0.5) / 2, rel=1e-3)     # row 2's stale token is gone
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, batch)
    cmask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    behave_eff = torch.where(torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).bool(),
                             behave, prox)
    ref, stats = decoupled_ppo_loss(prox, prox, behave_eff, batch["advantages"], cmask,
                                    versions=torch.tensor([3, 4, -1, 4]), current_version=4)
    assert stats["rejected_stale"] == 1 and stats["tokens"] == 9
    assert loss.item() == pytest.approx(ref.item(), rel=1e-3)      # π_prox: a forward, to float noise
    by_hand = -(1.5 * (2 + 0.5 + 1 + 1) - 0.5 * 3 - 1.0 * 2) / 9
    assert loss.item() == pytest.approx(by_hand, rel=1e-3)
