"""``balance-report``: did balancing lift the long tail? Figures before vs after, and a plot.

For a concept distribution ``n_c`` (assignments per concept; after: weighted by copies) with
``p_c = n_c / Σ n``:

* entropy ``H = −Σ p_c ln p_c`` (nats; ``ln V`` is the uniform maximum),
* share of the mass held by the top 1% of concepts (the head),
* concepts with ≥ 1 sample (vocabulary coverage),

and ``concept_coverage.png``: concept frequency against its rank, log–log, before and after —
the recipe's vocabulary-coverage figure. Written to ``RUN/balance-report/report.md``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ovpipe.step import Step, TaskContext


@dataclass
class BalanceReportConfig:
    head_fraction: float = 0.01  # the share of most frequent concepts counted as the head

    def __post_init__(self):
        if not 0 < self.head_fraction < 1:
            raise ValueError(f"head_fraction must be in (0, 1), got {self.head_fraction}")


def distribution_figures(counts: np.ndarray, head_fraction: float = 0.01) -> dict:
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    p = counts[counts > 0] / total if total else np.zeros(0)
    top = max(1, int(np.ceil(head_fraction * len(counts))))
    return {"entropy": float(-(p * np.log(p)).sum()) if len(p) else 0.0,
            "head_share": float(np.sort(counts)[::-1][:top].sum() / total) if total else 0.0,
            "concepts_covered": int((counts > 0).sum()),
            "total": int(total)}


def run(cfg: BalanceReportConfig, task: TaskContext) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cc = task.read_input("concept_counts")
    before = cc.column("count_before").to_numpy()
    after = cc.column("count_after").to_numpy()
    fb, fa = distribution_figures(before, cfg.head_fraction), distribution_figures(after, cfg.head_fraction)
    V = len(before)
    task.stats.info.update({f"before_{k}": v for k, v in fb.items()})
    task.stats.info.update({f"after_{k}": v for k, v in fa.items()})

    plt.figure(figsize=(6, 4))
    for arr, label in ((before, "before"), (after, "after balancing")):
        s = np.sort(arr[arr > 0])[::-1]
        plt.loglog(np.arange(1, len(s) + 1), s, label=label)
    plt.xlabel("concept rank")
    plt.ylabel("assignments")
    plt.title("concept-frequency coverage")
    plt.legend()
    plt.tight_layout()
    plt.savefig(task.step_dir / "concept_coverage.png", dpi=110)
    plt.close()

    top = max(1, int(np.ceil(cfg.head_fraction * V)))
    lines = ["| figure | before | after |", "| --- | ---: | ---: |",
             f"| entropy (nats; uniform = {np.log(V):.3f}) | {fb['entropy']:.4f} | {fa['entropy']:.4f} |",
             f"| share held by top {cfg.head_fraction:.0%} concepts ({top}) | {fb['head_share']:.4f} | {fa['head_share']:.4f} |",
             f"| concepts with ≥ 1 sample (of {V}) | {fb['concepts_covered']} | {fa['concepts_covered']} |",
             f"| concept assignments | {fb['total']} | {fa['total']} |"]
    demo = task.run_dir / "demo-clip" / "report.md"
    extra = "\n\nRetrieval quality of the demo model: see the demo-clip section." if demo.exists() else ""
    (task.step_dir / "report.md").write_text("\n".join(lines) + "\n\nPlot: concept_coverage.png" + extra + "\n")


STEP = Step("balance-report", BalanceReportConfig, run, inputs={"concept_counts": None}, max_tasks=1,
            description="concept coverage before vs after balancing")
