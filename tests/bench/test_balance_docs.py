"""docs/balance.md's straggler table is the one ``bench.balance_docs`` makes from bench/results/bench_balance.txt:
a new bench result rewrites it (``python -m bench.balance_docs --write``), and a hand edit of either fails here."""
from bench import balance_docs as B


def test_the_docs_straggler_table_is_the_bench_results():
    doc = B.DOC.read_text()
    made = B.docs_table(B.RESULTS.read_text())
    assert B.doc_with_table(doc, made) == doc, "docs/balance.md's table is stale: python -m bench.balance_docs --write"
    # the rows the review found apart: the balanced half-capacity 1M mix at DP 8 × 1 and DP 8 × 4
    row = next(ln for ln in made.splitlines() if "half-capacity" in ln)
    balanced = made.splitlines()[made.splitlines().index(row) + 1].split(" | ")
    assert (balanced[2], balanced[6]) == ("0.19%", "0.05%")
