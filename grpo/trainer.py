"""ovpipe's side of TRL's ``GRPOTrainer``: the registry's rewards, the two hooks the seeds' algorithms plug into,
and the per-step metrics that become the ``grpo_metrics`` manifest.

What TRL does stays TRL's: the sampler (``RepeatSampler``: ``num_generations`` rollouts of a prompt, contiguous),
generation (``model.generate``, transformers' continuous batching, vLLM colocate / server), the group advantages and
the clipped loss (``loss_type``, ``epsilon`` / ``epsilon_high``, ``beta``), checkpoints and resume (the HF
``Trainer``'s). ovpipe adds, in ``OvpipeGRPOTrainer``:

* **the batch hook** (``batch_reshaper``): TRL generates once per ``steps_per_generation`` micro-steps and buffers
  the result; the reshaper sees that whole buffer — the batch B that Shuffle-R1's Algorithm 1 reshapes — after the
  rewards and advantages are in and before TRL shuffles and splits it into micro-batches (a reshaper whose
  ``ordered`` is true — Shuffle-R1's sub-samplings — is split in its own order, unshuffled);
* **the rollout hook** is TRL's own ``rollout_func`` (SortedRL's engine adapter), passed through by the step;
* **behaviour weights** for the tokens such a rollout carries from earlier policy versions (SortedRL's partial
  mode): AReaL's decoupled-loss weight ``π_prox / π_behave``, dropped above its cap (``grpo.loss``), applied
  through TRL's per-token advantages (``_add_behaviour_weights``, ``_compute_loss``); TRL 1.16 corrects for the
  sampler only under vLLM;
* **processor outputs the model does not take** (a newer processor's ``mm_token_type_ids`` for the published
  LLaVA-OneVision-1.5 remote class) are dropped at the processor, for generation and for the loss's forward alike —
  the rule ``inference.backends`` applies before ``generate``;
* **metrics** of every optimizer step (``StepMetrics``), from the tensors of the batch itself.

Rewards (``RegistryReward``) are ``rl_select.rewards``' functions through ``RewardRunner``: the same rules, worker
processes and time limits as ``ovpipe score``. A reward that times out or raises scores 0 with its status counted,
never a dead step. The recipe's shift and scale (AReaL's ``reward_bias = −0.5``, ``reward_scaling = 10``) are applied
to the summed reward; under group normalisation they cancel out of the advantages (what changes is only the
``+ 1e-4`` of the std in TRL's denominator), so they are kept for the logged reward's scale and for parity with
the recipe's logs.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

try:                                     # the trainer only exists where TRL is installed (the `grpo` extra)
    from transformers import TrainerCallback
    from trl import GRPOTrainer
    from trl.trainer.utils import RepeatSampler
except ImportError as e:                 # pragma: no cover - the lock installs TRL
    raise ImportError(f"`ovpipe grpo` needs TRL: install the `grpo` extra (make install) — {e}") from None

from grpo.loss import GRPOConfig, behaviour_weights

BEHAVE_WEIGHT_CAP = GRPOConfig.behave_weight_cap     # AReaL's behav_imp_weight_cap (grpo.loss)
ZERO = 1e-8                 # a reward std at or under this: the group's rollouts all scored the same


# ----------------------------------------------------------------------------------------------- rewards

class RegistryReward:
    """One TRL reward function over the registry: each completion is scored by its prompt's ``answer_type`` with
    the prompt's ``ground_truth`` and ``reward_params`` (dataset columns, which TRL passes as keyword lists).

    ``kind`` ``"accuracy"`` scores by answer type; ``"format"`` applies the registry's ``format`` rule (the recipe's
    chain-of-thought format reward). Statuses are counted in ``self.status`` (``ok`` / ``timeout`` / ``error`` /
    ``bad_response``) for the step's metrics."""

    def __init__(self, runner, kind: str = "accuracy"):
        self.runner, self.kind = runner, kind
        self.__name__ = f"ovpipe_{kind}"       # TRL names the reward's metrics after it
        self.status: dict[str, int] = {}

    def __call__(self, prompts, completions, answer_type, ground_truth, reward_params, **_) -> list[float]:
        texts = [completion_text(c) for c in completions]
        if self.kind == "format":
            jobs = [("format", t, "", "{}") for t in texts]
        else:
            jobs = list(zip(answer_type, texts, ground_truth, reward_params))
        out = []
        for reward, _correct, status, _error in self.runner.score(jobs):
            self.status[status] = self.status.get(status, 0) + 1
            out.append(float(reward) if status == "ok" else 0.0)
        return out


def completion_text(c) -> str:
    """TRL hands a conversational completion as ``[{"role": "assistant", "content": …}]``, a plain one as text."""
    if isinstance(c, list):
        return "".join(m["content"] if isinstance(m.get("content"), str) else
                       "".join(p.get("text", "") for p in m.get("content") or []) for m in c)
    return c or ""


# ----------------------------------------------------------------------------------------------- processor

def drop_unaccepted_outputs(processor, model) -> list[str]:
    """Make ``processor`` leave out the outputs ``model.forward`` does not take (by name; a forward with
    ``**kwargs`` takes all). TRL passes the processor's whole output to ``generate`` and to the loss's forward; the
    published LLaVA-OneVision-1.5 class predates ``mm_token_type_ids``, which transformers 5's Qwen2-VL-family
    processors add, and ``generate`` refuses it. The processor's class is swapped for a subclass whose ``__call__``
    filters — TRL calls the processor both directly and through ``apply_chat_template``. Returns the dropped names."""
    import inspect

    params = inspect.signature(model.forward).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()) or not hasattr(processor, "image_processor"):
        return []
    accepted = set(params)
    dropped = [k for k in ("mm_token_type_ids", "token_type_ids") if k not in accepted]
    if not dropped:
        return []
    base = type(processor)

    def __call__(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        for k in dropped:
            out.pop(k, None)
        return out

    processor.__class__ = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    return dropped


# ----------------------------------------------------------------------------------------------- metrics

def batch_stats(batch: dict, num_generations: int, rewards: torch.Tensor | None, accelerator=None) -> dict[str, float]:
    """What one generation batch says about the signal it carries (rows = rollouts, groups contiguous):

    * ``small_advantage_share`` — rollouts with |A| < 0.1 (Shuffle-R1's advantage collapsing);
    * ``nonzero_grad_rollout_share`` — rollouts with A ≠ 0 (rollout silencing's complement);
    * ``token_utilization`` — generated tokens that carry a non-zero gradient (Shuffle-R1 Fig. 5c);
    * ``zero_std_group_share`` — groups whose rewards are all equal (no gradient from that prompt);
    * completion lengths, the reward's mean and std.

    Each process holds its slice of the batch (TRL's rewards are gathered, the rows are not): with
    ``accelerator`` the counts behind the shares (``grpo.symptoms``' definitions, shares times their totals) and
    the lengths' sum, min and max are reduced over the processes first, so rank 0 writes the whole batch's
    figures, as the Shuffle-R1 reshaper's own (``grpo.shuffle_r1.whole_buffer_stats``)."""
    from grpo.symptoms import batch_symptoms, loss_mask

    lengths = batch["completion_mask"].detach().double().sum(dim=1)
    s = batch_symptoms(batch)
    n, tokens = float(len(lengths)), float(loss_mask(batch).detach().double().sum())
    local = torch.tensor([n, s["small_advantage_share"] * n, s["nonzero_grad_rollout_share"] * n,
                          s["token_utilization"] * tokens, tokens, float(lengths.sum())], dtype=torch.float64,
                         device=lengths.device)
    lo, hi = lengths.min().reshape(1), lengths.max().reshape(1)
    if accelerator is not None and accelerator.num_processes > 1:
        local = accelerator.gather(local[None]).reshape(-1, len(local)).sum(dim=0)
        lo, hi = accelerator.gather(lo).min().reshape(1), accelerator.gather(hi).max().reshape(1)
    n, small, nonzero, useful, tokens, total_len = local.tolist()
    out = {"small_advantage_share": small / n, "nonzero_grad_rollout_share": nonzero / n,
           # no token generated: utilization is undefined (NULL), not 0
           "token_utilization": useful / tokens if tokens else math.nan,
           "completion_len_mean": total_len / n, "completion_len_min": float(lo), "completion_len_max": float(hi),
           "rollouts": n}
    if rewards is not None and len(rewards) and len(rewards) % num_generations == 0:
        r = rewards.detach().double().cpu()
        g = r.view(-1, num_generations)
        out.update(reward_mean=float(r.mean()), reward_std=float(r.std(unbiased=False)),
                   zero_std_group_share=float((g.std(dim=1, unbiased=False) < ZERO).double().mean()))
    return out


# TRL's logged names → the manifest's columns (grpo_metrics)
TRL_LOG = {"loss": "loss", "learning_rate": "lr", "grad_norm": "grad_norm",
           "clip_ratio/low_mean": "clip_ratio_low", "clip_ratio/high_mean": "clip_ratio_high",
           "clip_ratio/region_mean": "clip_ratio_region", "entropy": "entropy",
           "completions/clipped_ratio": "truncated_share"}


class StepMetrics(TrainerCallback):
    """One record per optimizer step, appended to ``path`` (JSON lines, flushed: a killed run keeps every finished
    step) and turned into the ``grpo_metrics`` manifest when the stage ends. The trainer's own batch statistics
    (``trainer.step_stats``, filled by ``OvpipeGRPOTrainer``) are merged with TRL's logged loss, learning rate and
    clip ratios, and with the step's wall time."""

    def __init__(self, path: Path, stage: str, trainer_ref: Callable[[], Any]):
        self.path, self.stage, self.trainer_ref = Path(path), stage, trainer_ref
        self._t0 = None

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        tr = self.trainer_ref()
        if self._t0 is not None:
            tr.step_stats["step_time_s"] = time.perf_counter() - self._t0

    def on_log(self, args, state, control, logs=None, **kw):
        tr = self.trainer_ref()
        if not tr.is_world_process_zero() or logs is None or "loss" not in logs:
            return
        rec = {"stage": self.stage, "step": int(state.global_step)}
        rec.update({col: _num(logs.get(name)) for name, col in TRL_LOG.items()})
        rec.update(tr.step_stats)
        rec["extras"] = json.dumps({k: v for k, v in logs.items() if k not in TRL_LOG and _num(v) is not None},
                                   sort_keys=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
            f.flush()
        tr.step_stats = {}


def _num(v):
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def read_records(path: Path, upto_step: int | None = None) -> list[dict]:
    """The records of ``path`` (last one per step wins), cut at ``upto_step``: a resumed stage drops the steps a
    killed run logged after its last checkpoint, which it is about to redo."""
    recs: dict[int, dict] = {}
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:           # a line cut by the kill
                continue
            if upto_step is None or r["step"] <= upto_step:
                recs[r["step"]] = r
    return [recs[k] for k in sorted(recs)]


# ----------------------------------------------------------------------------------------------- the trainer

class OvpipeGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with the batch hook and the step statistics (see the module docstring).

    ``batch_reshaper(batch, trainer) -> batch``: rows of TRL's generation-batch dict selected or reordered; the
    returned row count must stay divisible by ``steps_per_generation``. What it did goes in ``trainer.reshape_stats``
    (floats), written as ``reshape_*`` columns; a ``rollout_func`` puts its engine's figures in
    ``trainer.rollout_stats`` (``rollout_*`` columns)."""

    behave_weight_cap = BEHAVE_WEIGHT_CAP
    max_staleness = GRPOConfig.max_staleness          # η of grpo.loss's staleness rule

    def __init__(self, *args, batch_reshaper: Callable | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_reshaper = batch_reshaper
        self.step_stats: dict[str, float] = {}
        self.reshape_stats: dict[str, float] = {}
        self.rollout_stats: dict[str, float] = {}
        self._last_rewards: torch.Tensor | None = None

    def _get_train_sampler(self, dataset=None):
        return EpochSeededRepeatSampler.of(super()._get_train_sampler(dataset))

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        w = self.reward_weights.to(per_func.device)
        self._last_rewards = (per_func * w.unsqueeze(0)).nansum(dim=1)   # the gathered batch, every process
        return per_func

    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.step_stats["generate_s"] = time.perf_counter() - t0
            tokens = float(batch["completion_mask"].sum())
            self.step_stats["generated_tokens"] = tokens
            self.step_stats["generate_tokens_per_s"] = tokens / max(self.step_stats["generate_s"], 1e-9)
            self._add_behaviour_weights(batch, inputs)
        return batch

    def _add_behaviour_weights(self, batch: dict, inputs: list[dict]) -> None:
        """Partial-mode SortedRL's decoupled-loss weights: a rollout resumed across updates holds tokens an earlier
        policy sampled; each such token is weighted by AReaL's behaviour importance weight ``π_prox / π_behave``,
        dropped (weight 0) above the cap (``grpo.loss.behaviour_weights``). π_behave is the engine's log-prob of the
        sampled token (the rollout's ``logprobs``, TRL's ``sampling_per_token_logps``); π_prox is the policy at the
        start of this update, the weights TRL's ratio is taken against (``old_per_token_logps`` where TRL computed
        them, else one no-grad forward here, as TRL does under vLLM). Tokens of the trained version keep weight 1
        exactly and a batch without stale tokens is left untouched, so on-policy mode and plain GRPO train as TRL
        does. TRL 1.16 applies its own importance-sampling ratio only under vLLM; ``_compute_loss`` applies these.

        Which tokens are stale comes from the rollout's extra fields (``token_versions``, ``trained_version``, which
        TRL writes into ``inputs``, row for row with the batch). Figures go to ``step_stats`` as ``behave_*``."""
        if not inputs or "token_versions" not in inputs[0] or "trained_version" not in inputs[0]:
            return
        mask = batch["completion_mask"].bool()
        if "tool_mask" in batch:
            mask = mask & batch["tool_mask"].bool()
        stale = torch.zeros_like(mask)
        for i, inp in enumerate(inputs):
            vs = torch.as_tensor(inp["token_versions"][: mask.size(1)])
            stale[i, : len(vs)] = vs < int(inp["trained_version"])
        stale &= mask
        n_stale = int(stale.sum())
        self.step_stats["behave_stale_token_share"] = n_stale / max(int(mask.sum()), 1)
        # before the early return: the rejection gathers a token count over the processes, so every process calls
        # it on every step, whether or not its own slice holds stale tokens
        self._reject_stale_rollouts(batch, inputs, mask)
        if n_stale == 0:
            return
        stale &= mask
        behave = batch.get("sampling_per_token_logps")
        if behave is None:
            raise RuntimeError("sortedrl: the rollout has tokens of earlier policy versions but no log-probs; the "
                               "behaviour weights need the engine's log-prob of every sampled token")
        prox = batch.get("old_per_token_logps")
        if prox is None:
            from trl.models.utils import disable_gradient_checkpointing

            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                prox, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, attn, batch["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size)
        w, capped = behaviour_weights(prox, behave, self.behave_weight_cap)
        w = torch.where(stale, w, torch.ones_like(w))
        batch["behaviour_weights"] = w
        ws = w[stale]
        self.step_stats.update(behave_weight_mean=float(ws.mean()), behave_weight_max=float(ws.max()),
                               behave_weight_min=float(ws.min()),
                               behave_capped_share=float(capped[stale].double().mean()))

    def _reject_stale_rollouts(self, batch: dict, inputs: list[dict], mask: torch.Tensor) -> None:
        """The decoupled loss's staleness rule (``grpo.loss``: a sample generated more than η = 4 policy versions
        before the one it trains is rejected, its mask 0): a rollout whose oldest token (its ``policy_version``, the
        version it was admitted under) lags ``trained_version`` by more than ``max_staleness`` leaves the loss and
        its denominator — as TRL's own ``mask_truncated_completions`` does, ``completion_mask`` and
        ``num_items_in_batch`` (the token count over every process) both lose its tokens. A collective: every
        process calls it on every step that carries rollout versions."""
        rows = [i for i, inp in enumerate(inputs)
                if inp.get("token_versions") and
                int(inp["trained_version"]) - min(int(v) for v in inp["token_versions"]) > self.max_staleness]
        tokens = torch.zeros((), dtype=torch.long, device=mask.device)
        if rows:
            idx = torch.as_tensor(rows, device=mask.device)
            tokens = mask[idx].sum().long()
            batch["completion_mask"] = batch["completion_mask"].clone()
            batch["completion_mask"][idx] = 0
            if "tool_mask" in batch:
                batch["tool_mask"] = batch["tool_mask"].clone()
                batch["tool_mask"][idx] = 0
            mask[idx] = False
        if "num_items_in_batch" in batch:
            accelerator = getattr(self, "accelerator", None)
            dropped = accelerator.gather(tokens.reshape(1)).sum() if accelerator is not None else tokens
            batch["num_items_in_batch"] = batch["num_items_in_batch"] - dropped.to(batch["num_items_in_batch"].device)
        if rows:
            self.step_stats["behave_rejected_stale_rollouts"] = len(rows)
            self.step_stats["behave_rejected_stale_tokens"] = int(tokens)

    def _compute_loss(self, model, inputs):
        # the behaviour weights scale each token's clipped surrogate. TRL's loss takes per-token advantages
        # ([B, T], "to support subclasses") and every loss type is linear in A with w >= 0 —
        # max(−wA·r, −wA·clip(r)) = w · max(−A·r, −A·clip(r)) — so w·A is the decoupled loss's w · ℓ_t, exactly,
        # with TRL's own normalisation; a dropped token (w = 0) stays in the denominator, as in AReaL.
        w = inputs.get("behaviour_weights")
        if w is None:
            return super()._compute_loss(model, inputs)
        a = inputs["advantages"]
        return super()._compute_loss(model, {**inputs, "advantages": (a.unsqueeze(1) if a.dim() == 1 else a) * w})

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if not (self._step % generate_every == 0 or self._buffered_inputs is None):
            return super()._prepare_inputs(generation_batch)
        # A new generation: score it here (as TRL's own _prepare_inputs would), reshape the whole buffer, then let
        # TRL shuffle and split it. `_generate_and_score_completions` is swapped for the batch just made, once.
        batch = self._generate_and_score_completions(generation_batch)
        accelerator = getattr(self, "accelerator", None)       # a trainer under construction in a test has none
        self.step_stats.update(_prefixed("generated_", batch_stats(batch, self.num_generations, self._last_rewards,
                                                                   accelerator)))
        if self.batch_reshaper is not None:
            self.reshape_stats = {}
            batch = self.batch_reshaper(batch, self)
            self.step_stats.update(_prefixed("reshape_", self.reshape_stats))
        self.step_stats.update(batch_stats(batch, self.num_generations,
                                           self._last_rewards if self.batch_reshaper is None else None,
                                           accelerator))
        if self.batch_reshaper is not None:
            # the reshaper's own symptom figures (the same definitions, summed over the processes the same way)
            for k in ("small_advantage_share", "nonzero_grad_rollout_share", "token_utilization"):
                if k in self.reshape_stats:
                    self.step_stats[k] = self.reshape_stats[k]
        if self._last_rewards is not None:
            r = self._last_rewards.detach().double().cpu()
            self.step_stats.setdefault("reward_mean", float(r.mean()))
            self.step_stats.setdefault("reward_std", float(r.std(unbiased=False)))
            self.step_stats.setdefault("zero_std_group_share", self.step_stats.get("generated_zero_std_group_share"))
        self.step_stats.update(_prefixed("rollout_", self.rollout_stats))
        for f in self.reward_funcs:
            for status, n in getattr(f, "status", {}).items():
                self.step_stats[f"reward_{status}"] = float(n)
            if hasattr(f, "status"):
                f.status = {}
        if getattr(self.batch_reshaper, "ordered", False):
            # the reshaper's row order is its method (Shuffle-R1's S sub-samplings one after another, the static
            # reorder): split it into micro-batches in that order, as TRL does after its shuffle
            from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

            chunks = split_tensor_dict(split_pixel_values_by_grid(batch), self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(c) for c in chunks]
            return self._buffered_inputs[self._step % self.args.steps_per_generation]
        original = self._generate_and_score_completions
        self._generate_and_score_completions = lambda _inputs: batch
        try:
            return super()._prepare_inputs(generation_batch)
        finally:
            self._generate_and_score_completions = original


class EpochSeededRepeatSampler(RepeatSampler):
    """TRL's ``RepeatSampler`` whose ``set_epoch(e)`` reseeds its generator with ``seed + e``: each epoch's prompt
    order is a function of (seed, epoch) alone. TRL's own draws every epoch's permutation from one generator seeded
    once, so a run resumed after an epoch boundary (its sampler starts fresh) would see another order than the run
    it resumes; the HF Trainer calls ``set_epoch`` before each epoch, resumed or not."""

    @classmethod
    def of(cls, sampler: RepeatSampler) -> "EpochSeededRepeatSampler":
        new = cls.__new__(cls)
        new.__dict__.update(sampler.__dict__)
        return new

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle:
            self.generator.manual_seed((self.seed or 0) + int(epoch))


def _prefixed(prefix: str, d: dict) -> dict:
    return {f"{prefix}{k}": v for k, v in d.items()}
