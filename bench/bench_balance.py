"""Straggler loss before and after balanced steps (``packing.compute_balance``), from pack costs alone.

    python -m bench.bench_balance                       # the tables of docs/balance.md
    python -m bench.bench_balance --quick               # 100K-sample mixes
    python -m bench.bench_balance --run-dir RUN         # also a run's pack steps (make demo's runs/demo)
    python -m bench.bench_balance --epochs              # later epochs: docs/balance.md's epochs table (~2 s)

Straggler loss = mean over whole steps of (slowest rank's cost ÷ mean rank's cost) − 1, at DP 8, 32, 64, 128
with 1 and 4 micro-batches of one pack per rank and step. Costs: ``packing.cost`` with the 4B stage-1.5 FLOP
weights. Rows:

- ``before``: the packs in the order ``pack`` writes without balancing (BFD's bins in a seeded shuffle);
- ``lpt`` / ``kk``: ``packing.compute_balance.order`` (window 32 steps), greedy LPT or Karmarkar–Karp;
- ``cost-bound``: the other way — pack to a cost bound as well as the token bound (every item's length taken
  as ``max(L, ⌈cost/K·C⌉)``, K the median cost of a token-bound pack), in the seeded shuffle; its fill says
  what the bound costs in tokens per pack.

Mixing: the largest move of any pack (steps), and the spread over steps of each step's share of caption
tokens (std, percentage points) before and after — balancing may group packs of a kind within a window, and
this says by how much.

The realistic mix (``realistic_mix``, 1M samples, seq_len 8192):

- 45% captions: 1 image (80%) or 2 + Geometric(0.35) images (≤ 16); text lognormal(4.3, 1.0) + 24 tokens
  (≤ 2000) + 12 per extra image;
- 35% multi-turn conversations: 1 + Geometric(0.3) turn pairs (≤ 30), lognormal(4.8, 0.9) + 12 tokens each;
  images: none 30%, one 50%, 2–6 (uniform) 20%;
- 20% text only: lognormal(6.0, 1.1) tokens;
- every image: side lognormal around 700 px (σ 0.55), aspect lognormal (σ 0.35), Qwen2-VL smart resize
  (``packing.image_tokens``); a sample over 8192 tokens is dropped (counted in the header).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

DPS = (8, 32, 64, 128)
ACCUMS = (1, 4)


def _images(rng, k: int):
    from packing.tokens import ImageTokenConfig, image_grid

    side = np.exp(rng.normal(np.log(700), 0.55, k))
    aspect = np.exp(rng.normal(0, 0.35, k))
    h = np.clip(side / np.sqrt(aspect), 32, 4000).astype(np.int64)
    w = np.clip(side * np.sqrt(aspect), 32, 4000).astype(np.int64)
    return np.prod(image_grid(h, w, ImageTokenConfig()), axis=0)


def realistic_mix(n: int, seed: int = 0, C: int = 8192) -> dict:
    """Per sample: ``L`` (tokens), ``image_tokens`` (merged + 2 per image), ``images``, ``vit_sq``, ``kind``
    (0 caption, 1 conversation, 2 text) — the module docstring's distributions; samples over ``C`` dropped."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, n, p=[0.45, 0.35, 0.20])
    n_img = np.zeros(n, np.int64)
    cap, conv = kind == 0, kind == 1
    n_img[cap] = np.where(rng.random(cap.sum()) < 0.8, 1, np.minimum(2 + rng.geometric(0.35, cap.sum()) - 1, 16))
    u = rng.random(conv.sum())
    n_img[conv] = np.where(u < 0.3, 0, np.where(u < 0.8, 1, rng.integers(2, 7, conv.sum())))
    text = np.zeros(n, np.int64)
    text[cap] = np.minimum(rng.lognormal(4.3, 1.0, cap.sum()).astype(np.int64) + 24, 2000) + 12 * (n_img[cap] - 1)
    pairs = np.minimum(rng.geometric(0.3, conv.sum()), 30)
    owner = np.repeat(np.arange(conv.sum()), pairs)
    text[conv] = np.bincount(owner, weights=rng.lognormal(4.8, 0.9, len(owner)) + 12, minlength=conv.sum())
    txt = kind == 2
    text[txt] = rng.lognormal(6.0, 1.1, txt.sum()).astype(np.int64) + 1
    patches = _images(rng, int(n_img.sum()))
    img_owner = np.repeat(np.arange(n), n_img)
    itok = np.bincount(img_owner, weights=patches // 4 + 2, minlength=n).astype(np.int64)
    vit_sq = np.bincount(img_owner, weights=(patches + 1.0) ** 2, minlength=n).astype(np.int64)
    L = text + itok
    keep = L <= C
    return {"L": L[keep], "image_tokens": itok[keep], "images": n_img[keep], "vit_sq": vit_sq[keep],
            "kind": kind[keep], "dropped": int((~keep).sum())}


def one_image_mix(L: np.ndarray, patches: np.ndarray) -> dict:
    """``bench_packing``'s one-image-per-sample distributions, with their images' counts."""
    return {"L": L, "image_tokens": patches // 4 + 2, "images": np.ones(len(L), np.int64),
            "vit_sq": (patches.astype(np.int64) + 1) ** 2, "kind": np.zeros(len(L), np.int64), "dropped": 0}


def text_mix(L: np.ndarray) -> dict:
    z = np.zeros(len(L), np.int64)
    return {"L": L, "image_tokens": z, "images": z, "vit_sq": z, "kind": np.full(len(L), 2), "dropped": 0}


def packed(mix: dict, C: int, seed: int = 0, length=None):
    """BFD packing (``binpack.pack``, seeded bin shuffle) → per pack cost, tokens and caption tokens."""
    from manifests.ids import splitmix64
    from packing.binpack import pack
    from packing.cost import cost_of, pack_stats, weights

    n = len(mix["L"])
    P = pack(mix["L"] if length is None else length, C, keys=splitmix64(np.arange(n, dtype=np.uint64)), seed=seed)
    it = P.item
    stats = pack_stats(mix["L"][it], mix["image_tokens"][it], mix["images"][it], mix["vit_sq"][it], P.start)
    cap = np.where(mix["kind"][it] == 0, mix["L"][it], 0)
    caption = np.zeros(P.n_bins, np.int64)
    full = P.start[:-1] < P.start[1:]
    caption[full] = np.add.reduceat(cap, P.start[:-1][full])
    return cost_of(stats, weights()), stats["tokens"], caption


def sample_costs(mix: dict) -> np.ndarray:
    from packing.cost import cost_of, pack_stats, weights

    n = len(mix["L"])
    return cost_of(pack_stats(mix["L"], mix["image_tokens"], mix["images"], mix["vit_sq"], np.arange(n + 1)),
                   weights())


def caption_share_std(caption, tokens, dp, ga) -> float:
    """Std over whole steps of each step's caption-token share, in percentage points."""
    G = dp * ga
    s = len(tokens) // G
    if not s:
        return float("nan")
    cap = caption[:s * G].reshape(s, G).sum(1)
    tok = tokens[:s * G].reshape(s, G).sum(1)
    return float(100 * np.std(cap / np.maximum(tok, 1)))


def mixing(cost, caption, tokens, method: str | None = None, window: int = 32) -> str:
    """The caption-share std at DP 64 × 1 and × 4 (the order balanced for each, or as packed)."""
    from packing.compute_balance import order

    if caption.sum() == 0:
        return "–"
    out = []
    for ga in ACCUMS:
        p = order(cost, 64, 1, ga, window=window, method=method) if method else slice(None)
        out.append(f"{caption_share_std(caption[p], tokens[p], 64, ga):.2f}")
    return " / ".join(out)


def fmt(x) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def table(name: str, cost, tokens, caption, C: int, bound=None, window: int = 32) -> list[str]:
    """Markdown rows: straggler loss per (DP, micro-batches) for each option; mixing at DP 64."""
    from packing.compute_balance import displacement_steps, order, straggler_loss

    fill = tokens.sum() / (len(tokens) * C)
    rows = [f"| {name} | before | {fill:.2%} | " + " | ".join(fmt(straggler_loss(cost, dp, 1, ga))
                                                           for ga in ACCUMS for dp in DPS) + " | – | "
            + mixing(cost, caption, tokens) + " |"]
    for method in ("lpt", "kk"):
        cells, secs = [], 0.0
        for ga in ACCUMS:
            for dp in DPS:
                t0 = time.perf_counter()
                p = order(cost, dp, 1, ga, window=window, method=method)
                secs += time.perf_counter() - t0
                cells.append(fmt(straggler_loss(cost[p], dp, 1, ga)))
        p = order(cost, 64, 1, 1, window=window, method=method)
        rows.append(f"| {name} | {method} (W={window}, {secs:.1f} s for all 8) | {fill:.2%} | " + " | ".join(cells)
                    + f" | {displacement_steps(p, 64)} | {mixing(cost, caption, tokens, method, window)} |")
    if bound is not None:
        b_cost, b_tok, b_cap = bound
        b_fill = b_tok.sum() / (len(b_tok) * C)
        rows.append(f"| {name} | cost-bound packing | {b_fill:.2%} | " + " | ".join(
            fmt(straggler_loss(b_cost, dp, 1, ga)) for ga in ACCUMS for dp in DPS) + " | – | "
            + mixing(b_cost, b_cap, b_tok) + " |")
    return rows


def cost_bound(mix: dict, C: int, seed: int = 0):
    """Pack to a cost bound as well as the token bound: items sized ``max(L, ⌈cost/K·C⌉)`` (K: the median
    cost of a token-bound pack), so a bin of ≤ C such units holds ≤ C tokens and costs ≤ K."""
    cost, _, _ = packed(mix, C, seed)
    K = float(np.median(cost))
    eff = np.minimum(np.maximum(mix["L"], np.ceil(sample_costs(mix) / K * C).astype(np.int64)), C)
    return packed(mix, C, seed, length=eff)


def run_packs(run_dir: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(step, cost, tokens) of every pack step of a run, in pack_id order."""
    from pathlib import Path

    import pyarrow.parquet as pq

    from manifests.io import manifest_files

    out = []
    for d in sorted(Path(run_dir).iterdir()):
        try:
            files = manifest_files(run_dir, "packs", d.name)
        except FileNotFoundError:
            continue
        t = [pq.read_table(f, columns=["cost", "total_tokens"]) for f in files]
        out.append((d.name, np.concatenate([x.column("cost").to_numpy() for x in t]),
                    np.concatenate([x.column("total_tokens").to_numpy() for x in t]).astype(np.int64)))
    return out


HEAD = ("| mix | order | fill | " + " | ".join(f"DP {dp} × {ga}" for ga in ACCUMS for dp in DPS)
        + " | max move (steps, DP 64 × 1) | caption-token share std (pp, DP 64 × 1 / × 4) |\n| --- | --- | ---: | "
        + " | ".join("---:" for _ in range(len(ACCUMS) * len(DPS))) + " | ---: | ---: |")


def epochs_table(n: int = 20_037, sigma: float = 0.25, seed: int = 0) -> list[str]:
    """ovpipe issue 67's table: ``n`` lognormal(0, σ) pack costs (n mod G ≠ 0 at every layout), balanced by ``order``:
    the input, epoch 1, epoch 2 of ``pack_id`` order replayed as one stream (the loader before the balanced
    stream: every step straddles two balanced ones), and epochs 2 and 3 and a 3-epoch run of the balanced stream
    (``packing.compute_balance``, **Epochs**)."""
    from packing.compute_balance import epoch_straggler_losses, order, run_straggler_loss, straggler_loss

    c = np.random.default_rng(seed).lognormal(0.0, sigma, n)
    out = [f"{n:,} lognormal(0, {sigma}) pack costs, seed {seed}; kk, window 32",
           "| layout | n mod G | before | epoch 1 | epoch 2, pack_id order replayed | epoch 2 | epoch 3 | 3-epoch run |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for dp, ga in [(8, 1), (64, 1), (64, 4)]:
        G = dp * ga
        b = c[order(c, dp, 1, ga)]
        replayed = straggler_loss(np.tile(b, 2)[n // G * G:][:n // G * G], dp, 1, ga)
        e = epoch_straggler_losses(b, dp, 1, ga, epochs=3)
        run = run_straggler_loss(b, G, dp, 1, ga, steps=3 * n // G)
        out.append(f"| DP {dp} × {ga} | {n % G} | {fmt(straggler_loss(c, dp, 1, ga))} | {fmt(e[0])} | "
                   f"{fmt(replayed)} | {fmt(e[1])} | {fmt(e[2])} | {fmt(run)} |")
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.bench_packing import demo_like, half_capacity, lognormal, realistic

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--run-dir", help="also the pack steps of this run (make demo: runs/demo)")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--epochs", action="store_true", help="only the later-epochs table (docs/balance.md)")
    a = ap.parse_args(argv or [])
    if a.epochs:
        print("\n".join(epochs_table()))
        return 0
    n1 = 100_000 if a.quick else 1_000_000
    print(HEAD)
    if a.run_dir:
        for step, cost, tokens in run_packs(a.run_dir):
            for line in table(f"{a.run_dir} {step} ({len(cost):,} packs)", cost, tokens, np.zeros(len(cost)),
                              int(tokens.max(initial=1)), window=a.window):
                print(line, flush=True)
    mix = realistic_mix(n1)
    cost, tokens, caption = packed(mix, 8192)
    name = f"realistic mix {len(mix['L']):,} ({mix['dropped']:,} over 8192 dropped; {len(cost):,} packs)"
    for line in table(name, cost, tokens, caption, 8192, cost_bound(mix, 8192), a.window):
        print(line, flush=True)
    holdout = [("bench_packing demo-like", one_image_mix(*demo_like(20_000 if a.quick else 200_000, patches=True)),
                1024),
               (f"bench_packing realistic {n1:,}", one_image_mix(*realistic(n1, patches=True)), 8192),
               (f"bench_packing lognormal {n1:,} (text)", text_mix(lognormal(n1, 8192)), 8192),
               (f"bench_packing half-capacity {n1:,} (text)", text_mix(half_capacity(n1, 8192)), 8192)]
    for name, m, C in holdout:
        cost, tokens, caption = packed(m, C)
        for line in table(f"{name} ({len(cost):,} packs)", cost, tokens, caption, C, window=a.window):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
