"""A pack's cost (``packing.cost``) against its measured forward + backward time, pack by pack.

    python -m bench.bench_pack_cost --run-dir RUN --step pack --recipe tiny --repeats 3          # CPU
    python -m bench.bench_pack_cost --run-dir RUN --recipe llava-ov-1.5-4b --device cuda \\
        --fit-out weights.json                                                                  # bench/gpu

Every pack of the step (``--max-packs`` at most) is one micro-batch through the recipe's model, built fresh
(``pretrain.model.vlm.VLM``, the stage's trainable parts): forward, loss, backward, timed (CUDA events on the
GPU; on the CPU with ``--threads 1`` the process's CPU time, else host time), after ``--warmup`` untimed
packs, ``--repeats`` passes in a seeded order each. The
cost is recomputed from the manifest's counts with this recipe's FLOP weights (``RECIPE/STAGE`` of
``packing/cost_weights.json``), so the packs' own ``cost`` column (whatever weights it was written with) is not
needed. Reported: the Spearman rank correlation of time and cost per pass (their spread) and over the per-pack
median, the least-squares line time = a·cost + b with its R², and — with ``--fit-out`` — per-term weights
(seconds per unit count, non-negative least squares over the five counts, ``scipy.optimize.nnls``) written as a
``cost_weights`` file for ``pack``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def manifest_counts(run_dir: str, step: str) -> dict:
    """The five counts of ``packing.cost.TERMS`` per pack, keyed by pack_id, from the ``packs`` manifest."""
    from manifests.io import read_manifest

    t = read_manifest(run_dir, "packs", step=step,
                      columns=["pack_id", "total_tokens", "attn_sq", "images", "vit_tokens", "vit_sq"]).to_pydict()
    return {p: {"tokens": tok, "attn_sq": a, "vit_tokens": v, "vit_sq": s, "merged": (v - i) // 4}
            for p, tok, a, i, v, s in zip(t["pack_id"], t["total_tokens"], t["attn_sq"], t["images"],
                                          t["vit_tokens"], t["vit_sq"])}


def time_packs(run_dir: str, step: str, recipe_name: str, stage: str, device: str, max_packs: int, repeats: int,
               warmup: int, seed: int = 0) -> tuple[list[int], np.ndarray]:
    """(pack_ids, seconds ``[repeats, packs]``) of forward + backward, one pack a micro-batch."""
    import torch

    from packing.shards import iter_packed, packed_shards
    from pretrain.data import BatchPrep, collate
    from pretrain.model.vlm import VLM
    from pretrain.recipes import RECIPES, STAGES
    from pretrain.trainer.build import image_pad_id, setup_distributed
    from pretrain.trainer.loader import to_device

    setup_distributed(1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    r = RECIPES[recipe_name]
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    pad = image_pad_id(run_dir, None)
    model = VLM(r, pad, backend="sdpa" if not cuda else "auto").to(device=device, dtype=dtype)
    model.set_trainable(STAGES[stage].trainable)
    prep = BatchPrep(r.vit, r.llm.kv_channels, r.llm.rope_theta, pad, dtype)
    batches = []
    for sh in packed_shards(run_dir, step):
        for seq in iter_packed(sh):
            if len(batches) < max_packs:
                batches.append(prep(collate([seq])))
    ids = [b.pack_ids[0] for b in batches]

    def one(b) -> float:
        b = to_device(b, device)
        model.zero_grad(set_to_none=True)
        if cuda:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
        else:
            s = clock()
        ((model(b).float() * b.loss_mask).sum()).backward()
        if cuda:
            t1.record()
            torch.cuda.synchronize()
            return t0.elapsed_time(t1) / 1e3
        return clock() - s

    # one CPU thread: the process's CPU time, which a machine shared with other work does not stretch
    clock = time.process_time if not cuda and torch.get_num_threads() == 1 else time.perf_counter

    for b in batches[:warmup]:
        one(b)
    rng = np.random.default_rng(seed)
    secs = np.zeros((repeats, len(batches)))
    for k in range(repeats):
        for i in rng.permutation(len(batches)):
            secs[k, i] = one(batches[i])
        print(f"pass {k + 1}/{repeats}: {secs[k].sum():.1f} s over {len(batches)} packs", file=sys.stderr, flush=True)
    return ids, secs


def fit(cost: np.ndarray, secs: np.ndarray) -> dict:
    from scipy.stats import spearmanr

    med = np.median(secs, axis=0)
    a, b = np.polyfit(cost, med, 1)
    pred = a * cost + b
    r2 = 1 - float(((med - pred) ** 2).sum() / max(((med - med.mean()) ** 2).sum(), 1e-300))
    per_pass = [float(spearmanr(cost, s).statistic) for s in secs]
    return {"spearman_median": float(spearmanr(cost, med).statistic), "spearman_per_pass": per_pass,
            "slope_s_per_cost": float(a), "intercept_s": float(b), "r2": r2, "packs": int(len(cost)),
            "median_s": float(np.median(med)), "pass_cv_median": float(np.median(secs.std(0) / secs.mean(0)))}


def main(argv: list[str] | None = None) -> int:
    from packing.cost import TERMS, cost_of, weights

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", default="pack")
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--stage", default="1.5")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--max-packs", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--fit-out", help="write fitted per-term weights (seconds per unit) here")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    counts = manifest_counts(a.run_dir, a.step)
    ids, secs = time_packs(a.run_dir, a.step, a.recipe, a.stage, a.device, a.max_packs, a.repeats, a.warmup)
    X = {k: np.array([counts[i][k] for i in ids], np.float64) for k in TERMS}
    cost = cost_of(X, weights(f"{a.recipe}/{a.stage}"))
    res = {"recipe": a.recipe, "stage": a.stage, "device": a.device, "step": a.step, **fit(cost, secs)}
    if a.fit_out:
        from scipy.optimize import nnls

        A = np.stack([X[k] for k in TERMS] + [np.ones(len(ids))], axis=1)
        scale = A.max(axis=0)
        scale[scale == 0] = 1
        coef, _ = nnls(A / scale, np.median(secs, axis=0))
        w = {k: float(c / s) for k, c, s in zip(TERMS, coef, scale)}
        res["fitted"] = {**w, "intercept_s": float(coef[-1] / scale[-1])}
        with open(a.fit_out, "w") as f:
            json.dump(w, f, indent=1, sort_keys=True)
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
