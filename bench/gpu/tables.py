"""The tables of ``bench/gpu/next_call.sh``'s runs, in markdown for ``bench/results/<card>.md``:
``python -m bench.gpu.tables RESULTS_DIR --card h200`` (RESULTS_DIR: ``results.tgz`` unpacked, its ``r/``).
A run that did not come back is a row "to be measured"; nothing is filled in that was not measured.

- fp8 vs bf16 (the 4B stage 1.5): tokens/s, MFU against the bf16 peak, peak memory, the loss curves' agreement
  over the steps both ran (the largest |fp8 − bf16| / bf16 over the steps after the first ten: the first steps
  of a fresh model move fastest, where float8's rounding reorders the most);
- torchtitan vs ovpipe: tokens/s, MFU, peak memory per side and precision;
- optimizer offload: tokens/s, peak GPU memory, peak host memory, the losses;
- bf16's profile: the top operators by GPU time and the optimizer's share of the step.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TBD = "to be measured"
A_RUNS = [("bf16", "a_bf16"), ("fp8 tensorwise", "a_fp8_tensorwise"), ("fp8 rowwise", "a_fp8_rowwise")]
B_RUNS = [("torchtitan", "bf16", "b_titan_bf16"), ("ovpipe", "bf16", "b_ovpipe_bf16"),
          ("torchtitan", "fp8 rowwise", "b_titan_fp8_rowwise"), ("ovpipe", "fp8 rowwise", "b_ovpipe_fp8_rowwise")]
SKIP = 10            # steps left out of the loss agreement (see the docstring)


def load(d: Path, name: str) -> dict | None:
    f = d / f"{name}.json"
    return json.loads(f.read_text())["summary"] if f.exists() else None


def _dry(s: dict) -> str:
    return " (CPU dry run: no figure)" if s.get("dry_run") or s.get("cpu_dry_run") else ""


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def loss_gap(a: list, b: list, skip: int = SKIP) -> float | None:
    """Largest relative difference of two loss curves over the steps both ran, after the first ``skip``."""
    pairs = list(zip(a, b))[skip:]
    return max(abs(x - y) / abs(y) for x, y in pairs) if pairs else None


def fp8_table(d: Path) -> list[str]:
    base = load(d, "a_bf16")
    rows = ["| precision | tokens/s | MFU (vs the bf16 peak) | peak GiB | steps | loss gap vs bf16 (steps 11+) "
            "| final loss |", "|---|---|---|---|---|---|---|"]
    for label, name in A_RUNS:
        s = load(d, name)
        if s is None:
            rows.append(f"| {label} | {TBD} | {TBD} | {TBD} | – | {TBD} | {TBD} |")
            continue
        gap = loss_gap(s["losses"], base["losses"]) if base and name != "a_bf16" else None
        rows.append(f"| {label}{_dry(s)} | {_f(s['tokens_per_s_median'], ',.0f')} | {_f(s['mfu_median'], '.1%')} | "
                    f"{_f(s['peak_mem_gib'], '.1f')} | {len(s['losses'])} | {_f(gap, '.2%')} | "
                    f"{_f(s['losses'][-1] if s['losses'] else None, '.4f')} |")
    return rows


def titan_table(d: Path) -> list[str]:
    rows = ["| side | precision | tokens/s | MFU (vs the bf16 peak) | peak GiB | ovpipe / torchtitan |",
            "|---|---|---|---|---|---|"]
    got = {name: load(d, name) for _, _, name in B_RUNS}
    for side, prec, name in B_RUNS:
        s = got[name]
        if s is None:
            rows.append(f"| {side} | {prec} | {TBD} | {TBD} | {TBD} | |")
            continue
        ratio = ""
        if side == "ovpipe" and got.get(name.replace("ovpipe", "titan")):
            ratio = f"{s['tokens_per_s_median'] / got[name.replace('ovpipe', 'titan')]['tokens_per_s_median']:.2f}×"
        rows.append(f"| {side}{_dry(s)} | {prec} | {_f(s['tokens_per_s_median'], ',.0f')} | "
                    f"{_f(s['mfu_median'], '.1%')} | "
                    f"{_f(s['peak_mem_gib'], '.1f')} | {ratio} |")
    return rows


def offload_table(d: Path) -> list[str]:
    rows = ["| run | offload | recompute | tokens/s | peak GPU GiB | peak host GiB | losses |",
            "|---|---|---|---|---|---|---|"]
    for name, label in (("c_offload_4b", "4B stage 1.5, DP = 1, 79.2 GiB cap"),
                        ("e_8b_auto", "8B stage 1.5, DP = 1, recompute auto (the whole card)")):
        s = load(d, name)
        if s is None:
            rows.append(f"| {label} | {TBD} | {TBD} | {TBD} | {TBD} | {TBD} | {TBD} |")
            continue
        rows.append(f"| {label}{_dry(s)} | {s.get('optimizer_offload')} | "
                    f"{s.get('recompute')}/{s.get('vision_recompute')}/{s.get('loss_kernel')} | "
                    f"{_f(s['tokens_per_s_median'], ',.0f')} | {_f(s['peak_mem_gib'], '.1f')} | "
                    f"{_f(s.get('host_peak_rss_gib'), '.1f')} | {', '.join(f'{x:.4f}' for x in s['losses'])} |")
    rows.append(f"| tiny, 3 steps, offload 1 vs 0 | 1.0 / 0 | none | – | – | – | {offload_test(d)} |")
    return rows


def offload_test(d: Path) -> str:
    """The GPU test's outcome from the call's log (its losses within 2% of the GPU optimizer's, step 1 equal)."""
    log = (d / "log.txt").read_text() if (d / "log.txt").exists() else ""
    if "=== gpu tests" not in log:
        return TBD
    if "FAILED tests/pretrain/test_optimizer_offload.py" in log:
        return "failed (see the log)"
    return "within 2% (test passed)" if " passed" in log.split("=== gpu tests", 1)[1] else TBD


def profile_lines(d: Path) -> list[str]:
    f = d / "a_bf16.json"
    if not f.exists():
        return [f"bf16 profile (2 steps): {TBD}."]
    j = json.loads(f.read_text())
    s = j["summary"]
    return [f"bf16 profile over {s.get('profiled_steps', '–')} steps: optimizer "
            f"{_f(s.get('optimizer_share'), '.1%')} of the step, {_f(s.get('launches_per_step'), ',.0f')} launches per "
            f"step, GPU busy {_f(s.get('gpu_busy_s_per_step'), '.3f')} s per step.", "", "```",
            (j.get("profile_table") or TBD).rstrip(), "```"]


def render(d: Path, card: str) -> str:
    out = [f"### fp8 vs bf16: the 4B stage 1.5 on one {card.upper()}, one pack per step, same packs and seed", ""]
    out += fp8_table(d) + ["", f"### torchtitan beside ovpipe: the 4B's LLM alone, 8K-token packs, compile on", ""]
    out += titan_table(d) + ["", "### optimizer offload (megatron-core's HybridDeviceOptimizer)", ""]
    out += offload_table(d) + ["", "### where bf16's time goes", ""] + profile_lines(d)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="the unpacked results.tgz's r/ folder (any folder: a missing run is a row "
                                    "to be measured)")
    ap.add_argument("--card", default="h200")
    a = ap.parse_args(argv)
    sys.stdout.write(render(Path(a.results), a.card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
