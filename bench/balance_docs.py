"""docs/balance.md's table of straggler loss, generated from ``bench/results/bench_balance.txt`` (what
``python -m bench.bench_balance`` printed), so the two cannot drift: ``python -m bench.balance_docs --write``
rewrites the table between its markers in the doc; without ``--write`` it prints the table.
``tests/bench/test_balance_docs.py`` fails while the doc's table is not the one this makes.

The doc shows, per mix, the shuffle's order (``before``), the balancer the step uses (``kk``, window 32, as
``balanced``) and, for the realistic mix, the cost-bound packing; the DP columns only (the bench's file keeps the
fill, the other balancer and the mixing columns)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bench_balance.txt"
DOC = ROOT / "docs" / "balance.md"
BEGIN = ("<!-- straggler table: generated from bench/results/bench_balance.txt by "
         "`python -m bench.balance_docs --write` -->")
END = "<!-- end of the generated straggler table -->"
DP = ["DP 8 × 1", "DP 32 × 1", "DP 64 × 1", "DP 128 × 1", "DP 8 × 4", "DP 32 × 4", "DP 64 × 4", "DP 128 × 4"]
# the bench's mix (by the start of its label) → the doc's label, in the doc's order
MIXES = {"realistic mix ": "realistic 1M mix", "demo pack (": "demo `pack`", "bench_packing demo-like": None,
         "bench_packing realistic": None, "bench_packing lognormal": None, "bench_packing half-capacity": None}
BOLD = {("realistic mix ", "DP 64 × 1"), ("realistic mix ", "DP 64 × 4")}     # the goal's cells


def rows(text: str) -> list[dict]:
    """The bench table's rows as dicts keyed by its header."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def _label(mix: str, key: str) -> str:
    packs = re.search(r"([\d,]+) packs\)", mix).group(1)
    short = MIXES[key]
    if short is None:        # "bench_packing lognormal 1,000,000 (text)" → "bench_packing lognormal 1M, text"
        short = re.sub(r" \([\d,]+ packs\)$", "", mix).replace("1,000,000", "1M").replace(" (text)", ", text")
    extra = ", 1024 tokens" if key == "demo pack (" else ""
    return f"{short} ({packs} packs{extra})"


def docs_table(text: str) -> str:
    out = ["| mix | order | " + " | ".join(DP) + " |", "| --- | --- | " + " | ".join(["---:"] * len(DP)) + " |"]
    got = rows(text)
    for key in MIXES:
        mine = [r for r in got if r["mix"].startswith(key)]
        if not mine:
            raise ValueError(f"{RESULTS.name}: no rows for the mix {key.strip()!r}")
        first = True
        for r in mine:
            order = r["order"]
            if order == "before":
                name = "before"
            elif order.startswith("kk "):
                name = "balanced"
            elif order == "cost-bound packing":
                name = f"cost-bound packing (fill {r['fill']})"
            else:
                continue
            cells = [f"**{r[c]}**" if (key, c) in BOLD and name == "balanced" else r[c] for c in DP]
            lead = f"| {_label(r['mix'], key)} | " if first else "| | "
            out.append(lead + f"{name} | " + " | ".join(cells) + " |")
            first = False
    return "\n".join(out) + "\n"


def doc_with_table(doc: str, table: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{DOC}: no {BEGIN!r} … {END!r} markers")
    head, rest = doc.split(BEGIN, 1)
    return head + BEGIN + "\n" + table + rest[rest.index(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.balance_docs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC.relative_to(ROOT)}")
    a = ap.parse_args(argv)
    table = docs_table(RESULTS.read_text())
    if a.write:
        DOC.write_text(doc_with_table(DOC.read_text(), table))
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
