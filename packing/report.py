"""The packing report: how close to the physical limit, and how much padding we saved."""
from __future__ import annotations

import numpy as np


def padding_figures(tokens: int, seq_len: int, bins: int) -> dict:
    return {"bins": int(bins), "fill_rate": tokens / (bins * seq_len) if bins else 0.0,
            "padding_tokens": int(bins * seq_len - tokens)}


def packing_report(cfg, task) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ovpipe.mapreduce import load_arrays
    from packing.binpack import online_buffer_bins

    # what the reduce kept of the items (packing.solve): the length histogram and the lengths of the
    # first `report_max_samples` items in key order; the packs' loads in pack_id order
    summary = load_arrays(task.reduced_path("summary.npz"))
    counts = summary["counts"]
    totals = np.load(task.reduced_path("bin_load.npy"))
    C = cfg.seq_len
    n_items, tokens = int(counts.sum()), int(np.dot(np.arange(len(counts), dtype=np.int64), counts))
    lb = -(-tokens // C)
    ours = padding_figures(tokens, C, len(totals))
    pad_every = n_items * C - tokens                       # (a) every sample padded to seq_len
    fig = {"items": n_items, "tokens": tokens, "seq_len": C, "lower_bound": lb, **ours,
           "bins_over_lower_bound": ours["bins"] / lb if lb else 1.0,
           "padding_vs_pad_to_seq_len": pad_every / max(ours["padding_tokens"], 1)}
    # (b) online rolling-buffer packers, on the items in input (key) order
    sub = summary["report_lengths"]
    sub_ours_pad = None
    online = {}
    for B in cfg.report_buffers:
        nb = online_buffer_bins(sub, C, B)
        online[B] = padding_figures(int(sub.sum()), C, nb)
    if len(sub) < n_items:  # compare on the same subset
        from packing.binpack import pack

        sub_ours_pad = padding_figures(int(sub.sum()), C, pack(sub, C, shuffle_bins=False).n_bins)["padding_tokens"]
    base_pad = sub_ours_pad if sub_ours_pad is not None else ours["padding_tokens"]
    for B, f in online.items():
        fig[f"online_B{B}_bins"] = f["bins"]
        fig[f"online_B{B}_fill_rate"] = f["fill_rate"]
        fig[f"padding_vs_online_B{B}"] = f["padding_tokens"] / max(base_pad, 1)
    task.stats.info.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in fig.items()})

    fill = totals / C
    plt.figure(figsize=(6, 3.5))
    plt.hist(fill, bins=50, range=(min(0.5, float(fill.min()) if len(fill) else 0.5), 1.0), color="#3b6ea5")
    plt.xlabel("bin fill (tokens / seq_len)")
    plt.ylabel("bins")
    if len(totals):
        plt.yscale("log")
    plt.title(f"{len(totals)} bins, fill {ours['fill_rate']:.4%}, LB {lb}")
    plt.tight_layout()
    plt.savefig(task.step_dir / "fill_histogram.png", dpi=110)
    plt.close()

    count = ""
    if getattr(cfg, "count_for", "ovpipe") != "ovpipe":
        from packing.official import count_shift

        shift = count_shift(task.run_dir, cfg.count_for, cfg.lengths_step)
        count = (f" Lengths are the {cfg.count_for} trainer's count: `lengths` − {shift} per item "
                 f"(`count_for`); the packs' shard entries hold ovpipe's encoding, that many tokens more per item.")
    lines = [f"Packed {n_items} items ({tokens} tokens) into {ours['bins']} bins of {C} "
             f"(lower bound {lb}; bins/LB = {fig['bins_over_lower_bound']:.6f}).{count}", "",
             "| packer | bins | fill rate | padding tokens | our padding is … less |", "| --- | ---: | ---: | ---: | ---: |",
             f"| ovpipe BFD (hash buckets) | {ours['bins']} | {ours['fill_rate']:.4%} | {ours['padding_tokens']} | 1× |",
             f"| pad every sample to seq_len | {n_items} | {tokens / max(n_items * C, 1):.4%} | {pad_every} | "
             f"{fig['padding_vs_pad_to_seq_len']:.1f}× |"]
    for B, f in online.items():
        lines.append(f"| online buffer B={B} | {f['bins']} | {f['fill_rate']:.4%} | {f['padding_tokens']} | "
                     f"{fig[f'padding_vs_online_B{B}']:.1f}× |")
    if len(sub) < n_items:
        lines.append(f"\n(online baselines on the first {len(sub)} items, against ours on the same items)")
    lines.append("\nFill histogram: fill_histogram.png")
    (task.step_dir / "report.md").write_text("\n".join(lines) + "\n")
    (task.step_dir / "report.json").write_text(__import__("json").dumps(fig, indent=2) + "\n")
    return fig
