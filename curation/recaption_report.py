"""The recaption report (``RUN/<step>/report.md`` + ``caption_lengths.png``): captions per status and
language, caption-length histograms per language (characters), and a few examples per status.

Read with DuckDB straight from the step's ``captions`` parts — counts and histogram bins are SQL
aggregates and the examples a windowed ``LIMIT`` per status, so the reduce never holds the captions.
"""
from __future__ import annotations

BINS = [0] + [2 ** k for k in range(12)]      # caption length in characters: bin lower edges 0, 1, 2, 4, ..., 2048


def recaption_report(cfg, task) -> dict:
    parts = str(task.step_dir / "captions" / "part-*.parquet")
    with task.duckdb() as con:
        con.execute(f"CREATE VIEW captions AS SELECT * FROM read_parquet('{parts}')")
        counts = con.execute("SELECT lang, status, count(*) FROM captions GROUP BY ALL ORDER BY ALL").fetchall()
        hist = con.execute(f"""
            SELECT lang, CASE WHEN length(caption) = 0 THEN 0
                              ELSE least(CAST(2 ** floor(log2(length(caption))) AS BIGINT), {BINS[-1]}) END AS lo, count(*)
            FROM captions GROUP BY ALL ORDER BY ALL""").fetchall()
        examples = con.execute("""
            SELECT status, lang, sample_id, caption, error FROM (
              SELECT *, row_number() OVER (PARTITION BY status ORDER BY sample_id, lang) AS k FROM captions)
            WHERE k <= ? ORDER BY status, sample_id, lang""", [cfg.report_examples]).fetchall()
        speed = con.execute("SELECT count(*), sum(tokens) FROM captions WHERE finish_reason != 'error'").fetchone()

    langs = sorted({lang for lang, _, _ in counts})
    statuses = sorted({s for _, s, _ in counts}, key=lambda s: (s != "ok", s))
    table = {(lang, s): n for lang, s, n in counts}
    lines = ["# recaption", "", f"model `{cfg.model or '(from the file)'}`, backend `{cfg.backend}`, "
             "prompts: " + "; ".join(f"{lang} `{cfg.prompt_id(lang)}` “{cfg.prompts[lang]}”"
                                     for lang in sorted(cfg.prompts)),
             "", "## captions per status and language", "",
             "| status | " + " | ".join(langs) + " |", "| --- |" + " ---: |" * len(langs)]
    lines += [f"| {s} | " + " | ".join(str(table.get((lang, s), 0)) for lang in langs) + " |" for s in statuses]
    lines += ["", "## caption length (characters) per language", "",
              "| length ≥ | " + " | ".join(langs) + " |", "| ---: |" + " ---: |" * len(langs)]
    h = {(lang, lo): n for lang, lo, n in hist}
    lines += [f"| {lo} | " + " | ".join(str(h.get((lang, lo), 0)) for lang in langs) + " |"
              for lo in BINS if any((lang, lo) in h for lang in langs)]
    lines += ["", "## examples per status", ""]
    for status, lang, sid, caption, error in examples:
        text = (caption or "").replace("\n", " ").replace("|", "\\|")
        text = text[:200] + ("…" if len(text) > 200 else "")
        lines.append(f"- **{status}** `{lang}` `{sid}`: “{text}”" + (f" — {error}" if error else ""))
    lines += ["", "Plot: caption_lengths.png", ""]
    (task.step_dir / "report.md").write_text("\n".join(lines))
    _plot(task.step_dir / "caption_lengths.png", langs, h)
    figures = {"captions": int(speed[0] or 0), "generated_tokens": int(speed[1] or 0)}
    task.stats.info.update({"report": str(task.step_dir / "report.md"), **figures})
    return figures


def _plot(path, langs, h) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(BINS))
    w = 0.8 / max(len(langs), 1)
    for i, lang in enumerate(langs):
        ax.bar(x + i * w, [h.get((lang, lo), 0) for lo in BINS], width=w, label=lang)
    ax.set_xticks(x + 0.4 - w / 2, [f"≥{b}" for b in BINS], rotation=45)
    ax.set_xlabel("caption length (characters)")
    ax.set_ylabel("captions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
