"""Shuffle-R1 over verl's ``DataProto``: the reshaper of ``grpo/shuffle_r1.py`` for a verl trainer, run on the
batch after ``compute_advantage`` and before ``update_actor`` (verl 0.9.1's ``RayPPOTrainer.fit``; the export's
``verl/HANDOFF.md`` shows the two lines to add there).

The selection is ``grpo.shuffle_r1.reshape_indices`` itself — one definition of PTS and ABS — so for the same
advantages, seed and step this picks the rows that ``ovpipe grpo``'s TRL reshaper picks (``BatchReshaper`` at rank
0). What differs is only how verl lays a batch out:

* **Advantages** are token-level, ``batch["advantages"]`` ``[B, T]``: verl's GRPO writes each response's
  normalised score on its tokens (``scores.unsqueeze(-1) * response_mask``), so a row's advantage is the mean over
  its ``response_mask``. A batch whose advantages vary along a response (GAE, REINFORCE++ …) is refused: Shuffle-R1
  pairs outcome advantages (``algorithm.adv_estimator=grpo``).
* **Groups** are the rows sharing ``non_tensor_batch["uid"]``, not contiguous blocks: ``fit`` reorders the batch by
  sequence length across data-parallel ranks (``trainer.balance_batch``) before the advantages, so the rows are
  put in group order (first appearance, rollout order kept) before ``reshape_indices`` and mapped back after.
* **Rows** are selected with verl's own ``DataProto.select_idxs``: every tensor of ``batch`` and every array of
  ``non_tensor_batch`` (uids, ``multi_modal_inputs``, reward extras …) with the same index array. ``meta_info`` is
  kept (a copy); its two per-row/per-image lists that ``fit`` wrote before the advantages — ``global_token_num``
  (the throughput metric) and ``images_seqlens`` (the FLOPs counter) — are recomputed for the rows kept.
* **Mini-batches.** verl chunks the batch contiguously over the data-parallel ranks and each rank cuts its chunk
  into ``ppo_mini_batch_size × rollout.n / dp`` rows per optimizer step, in order when ``actor.shuffle=False``
  (its default). ``dp_size`` lays the S sub-samplings out so that optimizer step s on all ranks together is
  sub-sampling s exactly (rank r holds the r-th slice of each): with ``ppo_mini_batch_size × rollout.n = 2T`` each
  of the S updates of a training step is one of Algorithm 1's sub-samplings of T distinct pairs.

Imports: numpy and ``grpo.shuffle_r1`` (itself numpy only; torch is imported by it only to select TRL dicts, not
here). The tensors are verl's and the ``DataProto`` is the caller's, so nothing of ovpipe's training stack (TRL,
transformers, the step framework) is imported into verl's driver. Loadable by import (the repository on
``sys.path``) or by file path (``verl.utils.import_utils.load_extern_object(<this file>, "reshape_dataproto")``).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

if importlib.util.find_spec("grpo") is None:       # loaded by file path from verl's own environment
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.shuffle_r1 import VARIANTS, ShuffleR1Config, reshape_indices  # noqa: E402
from grpo.symptoms import nonzero_grad_rollout_share, small_advantage_share, token_utilization  # noqa: E402

METRIC_PREFIX = "shuffle_r1/"


def row_advantages(data) -> tuple[np.ndarray, np.ndarray]:
    """Each row's outcome advantage and its response-token count, from ``advantages`` and ``response_mask``."""
    adv = data.batch["advantages"].detach().float().cpu()
    mask = data.batch["response_mask"].detach().float().cpu()
    adv, mask = adv.numpy().astype(np.float64), mask.numpy().astype(np.float64)
    tokens = mask.sum(axis=1)
    a = (adv * mask).sum(axis=1) / np.maximum(tokens, 1.0)
    spread = np.abs(adv - a[:, None]) * mask
    if spread.size and float(spread.max()) > 1e-4 * (1.0 + float(np.abs(a).max())):
        raise ValueError("advantages vary along a response: Shuffle-R1 pairs outcome advantages, one per rollout "
                         "(algorithm.adv_estimator=grpo)")
    return a, tokens


def group_order(uid) -> tuple[np.ndarray, int]:
    """A permutation putting the rows of each ``uid`` next to each other (groups by first appearance, rows in batch
    order within a group), and the group size, which every group must share (verl's ``rollout.n``)."""
    uid = np.asarray(uid)
    _, first, inv, counts = np.unique(uid, return_index=True, return_inverse=True, return_counts=True)
    if (counts != counts[0]).any():
        raise ValueError(f"groups of unequal size ({sorted(set(counts.tolist()))} rows per uid): PTS pairs within "
                         f"whole groups of actor_rollout_ref.rollout.n rollouts")
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return np.argsort(rank[inv.reshape(-1)], kind="stable"), int(counts[0])


def reshape_dataproto(data, alpha: float = 0.5, S: int = 8, variant: str = "shuffle_r1", seed: int = 0,
                      step: int = 0, dp_size: int = 1):
    """Shuffle-R1 on a verl batch after ``compute_advantage``. Returns ``(batch, metrics)``.

    ``batch``: the ``DataProto`` of the 2·P rows kept (P = groups × ⌊α·N⌋ pairs), S sub-samplings of T = P / S
    distinct pairs, pair members next to each other, laid out for ``dp_size`` data-parallel ranks (see the module
    docstring). ``variant``: a row of the paper's Tab. 5 (``grpo.shuffle_r1.VARIANTS``). ``seed``/``step`` key the
    draw as the TRL path keys it (``np.random.default_rng([seed, step, 0])``): pass ``self.global_steps``.
    ``metrics``: rows in/out, pairs kept, S, T, the share of distinct pairs and both symptoms before (``_in``) and
    after, keyed ``shuffle_r1/…`` for ``fit``'s ``metrics``."""
    cfg = ShuffleR1Config(variant=variant, alpha=alpha, S=S, seed=seed)      # the same field checks as the step's
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size}: the data-parallel ranks the actor update runs on, at least 1")
    a, tokens = row_advantages(data)
    perm, n = group_order(data.non_tensor_batch["uid"])
    rng = np.random.default_rng([cfg.seed, int(step), 0])
    local, info = reshape_indices(a[perm], n, cfg.alpha, cfg.S, rng=rng, **VARIANTS[cfg.variant])
    rows = perm[local]
    per_sub = 2 * info["T"]
    if per_sub % dp_size:
        raise ValueError(f"a sub-sampling's {per_sub} rows (2T, T = {info['T']} pairs) do not split over "
                         f"dp_size={dp_size} ranks: choose shuffle_r1 S or the batch so that dp_size divides 2T")
    # [S, 2T] → rank r's chunk holds the r-th slice of every sub-sampling: verl's contiguous dispatch then makes
    # mini-batch s (ppo_mini_batch_size × rollout.n = 2T rows over all ranks) sub-sampling s
    rows = rows.reshape(info["S"], dp_size, per_sub // dp_size).transpose(1, 0, 2).reshape(-1)
    out = data.select_idxs(rows)
    out.meta_info = dict(data.meta_info)
    g = out.meta_info.get("global_token_num")
    if isinstance(g, (list, tuple)) and len(g) == len(a):
        out.meta_info["global_token_num"] = [g[i] for i in rows.tolist()]
    if "images_seqlens" in out.meta_info and "multi_modal_inputs" in out.non_tensor_batch:
        out.meta_info["images_seqlens"] = [x for mm in out.non_tensor_batch["multi_modal_inputs"]
                                           if "image_grid_thw" in mm for x in mm["images_seqlens"].tolist()]
    a_out, t_out = a[rows], tokens[rows]
    metrics = {"rows_in": len(a), "rows_out": len(rows), "pairs_kept": info["pairs_kept"], "S": info["S"],
               "T": info["T"], "distinct_pair_share": info["distinct_pair_share"],
               "small_advantage_share_in": small_advantage_share(a),
               "small_advantage_share": small_advantage_share(a_out),
               "nonzero_grad_rollout_share_in": nonzero_grad_rollout_share(a),
               "nonzero_grad_rollout_share": nonzero_grad_rollout_share(a_out),
               "token_utilization_in": token_utilization(a, tokens),
               "token_utilization": token_utilization(a_out, t_out)}
    return out, {METRIC_PREFIX + k: float(v) for k, v in metrics.items()}
