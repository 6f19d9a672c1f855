"""The table of issue 41's layouts on one card, from the runs `layouts` (bench/gpu/lib.sh) saved: per layout its
ranks, the path its collectives took (stage.json), the precision, and the largest relative differences of its
losses and grad norms from the one-rank GPU run of the same precision (fp32 `ref`, bf16 `ref-bf16`).

    python bench/gpu/layouts_table.py DIR     (DIR: the layouts/ folder of a device call's results.tgz)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(folder: Path) -> list[str]:
    runs = {p.name.removesuffix(".metrics.json"): json.loads(p.read_text())["metrics"]
            for p in sorted(folder.glob("*.metrics.json"))}
    out = ["| layout | ranks | collectives | precision | steps | max rel. Δloss | max rel. Δgrad norm |",
           "|---|---|---|---|---|---|---|"]
    for name, got in runs.items():
        if name.startswith("ref"):
            continue
        bf16 = name.endswith("-bf16")
        ref = runs.get("ref-bf16" if bf16 else "ref")
        st = folder / f"{name}.stage.json"
        stage = json.loads(st.read_text()) if st.exists() else {}
        ranks = stage.get("dp", 0) * stage.get("tp", 0) * stage.get("pp", 0) * stage.get("cp", 0) or "?"
        if ref is None:
            dl = dg = "no reference"
        else:
            by_step = {m.get("step", i): m for i, m in enumerate(ref)}     # a resumed run starts later
            pairs = [(by_step[m.get("step", i)], m) for i, m in enumerate(got) if m.get("step", i) in by_step]
            dl = f"{max(abs(a['loss'] - b['loss']) / abs(a['loss']) for a, b in pairs):.2e}"
            dg = (f"{max(abs(a['grad_norm'] - b['grad_norm']) / a['grad_norm'] for a, b in pairs):.2e}"
                  if all(a.get("grad_norm") for a, _ in pairs) else "—")
        out.append(f"| {name} | {ranks} | {stage.get('collectives', '?')} | {'bf16' if bf16 else 'fp32'} | "
                   f"{len(got)} | {dl} | {dg} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows(Path(sys.argv[1]))))
