"""``align``: image–text alignment, the CLIP score of each sample's image and its text, and a cut.

    score_i = cos(f_image(x_i), f_text(t_i))

with the image vector ``embed-images`` already wrote and the text through the **same** model's text tower
(``model`` / ``pretrained`` default to the embed step's own; batched, bf16 autocast on a GPU where present).
``t_i`` is the caption of a caption pair; a conversation (no single caption) is scored on its **first
user turn (``<image>`` removed) + first assistant turn**, joined by a space (``text_kind = first_turn``;
``conversations = skip`` writes them unscored, status ``skipped_conversation``). Texts are cut at the
text tower's context (77 tokens for CLIP) by its tokenizer.

A sample is ``low_alignment`` when ``score < threshold`` — a fixed ``threshold``, or per source the
``percentile``-th percentile of that source's scores (the lower edge of the 1/2048-wide score bin that
holds it, from per-source histograms: the same cut at any task count). Neither: scores only. Other
statuses: ``no_text`` (an empty text), ``bad_vector`` (an ``ok`` image vector with a NaN or ±inf component, or a
norm off 1 by more than 1%, all zeros say: it has no cosine, so the row is not scored, its text is not embedded,
and it is in no histogram) and, for a row without an image vector, the embed status (``decode_error``,
``empty_caption``, ...). Nothing is deleted; ``balance`` skips ``low_alignment`` rows when told to
(``alignment_step``).

Map → reduce → apply: map rank r embeds the texts of its canonical slice, writes the scores batch by
batch to a partial part and its per-source score histograms; the reduce sums the histograms and solves
the per-source thresholds; apply rank r streams its partial and writes its ``alignment`` part with the
cut applied (a temp name renamed when whole, then the marker: the partial stays, so an apply that dies at
any point is redone from it). Finalize: ``report.md`` and ``scores.png`` (score distribution per source),
then the spent partials are removed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from curation.dedup import BAD_VECTOR, BAD_VECTOR_ERROR, bad_vectors
from ovpipe.config import check_local_path, check_range, check_step_folder
from ovpipe.inputs import Input
from ovpipe.step import Step, TaskContext

BINS = 4096                       # score histogram over [-1, 1]: bins 1/2048 wide
SAMPLE_COLUMNS = ["sample_id", "source", "category", "caption", "conversation"]


@dataclass
class AlignConfig:
    threshold: float | None = None          # low_alignment: score below this (a fixed cut) ...
    percentile: float | None = None         # ... or below this percentile of the sample's source (0–100)
    conversations: Literal["first_turn", "skip"] = "first_turn"   # the text of a conversation: its first turns, or none
    model: str = ""                         # "": the embed step's model and checkpoint (the same towers)
    pretrained: str = ""                    # with `model`: its open_clip tag or checkpoint path
    batch_size: int = 256                   # texts encoded per forward pass
    device: str = "auto"                    # auto: cuda when present, else cpu
    embeddings_step: str = "embed-images"   # the image vectors scored (and, through it, the samples' texts)
    planted: str = ""                       # demo: planted.parquet — the report counts the mismatched captions found

    def __post_init__(self):
        if self.threshold is not None and self.percentile is not None:
            raise ValueError("threshold and percentile: give one cut (a fixed score, or a per-source percentile), "
                             f"got threshold={self.threshold}, percentile={self.percentile}")
        check_range(self, "threshold", -1, 1)
        check_range(self, "percentile", 0, 100, lo_open=True)
        check_range(self, "batch_size", 1)
        if self.conversations not in ("first_turn", "skip"):
            raise ValueError(f"conversations must be first_turn or skip, got {self.conversations!r}")
        check_step_folder("embeddings_step", self.embeddings_step)
        if self.planted:
            check_local_path("planted", self.planted)


def check(cfg: AlignConfig, run_dir) -> None:
    """Before any task: a model of its own (``model`` set) is an open_clip one, its checkpoint path exists."""
    if cfg.model:
        from curation.clip import check_clip

        check_clip(cfg.model, cfg.pretrained, run_dir)


def text_of(row: dict, conversations: str = "first_turn") -> tuple[str | None, str | None, str | None]:
    """(text, text_kind, status if not scored) of a ``samples`` row."""
    if row["category"] == "caption" or not row["conversation"]:
        text, kind = (row["caption"] or "").strip(), "caption"
    elif conversations == "skip":
        return None, None, "skipped_conversation"
    else:
        turns = row["conversation"]
        user = next((t["text"] for t in turns if t["role"] == "user"), "")
        answer = next((t["text"] for t in turns if t["role"] == "assistant"), "")
        text, kind = " ".join(s for s in (user.replace("<image>", " ").split() + answer.split())), "first_turn"
    return (text, kind, None) if text else (None, None, "no_text")


def score_bins(scores: np.ndarray) -> np.ndarray:
    """The histogram bin of each score in [−1, 1] (a score outside is clipped to the end bins; every score
    here is finite: ``bad_vector`` rows are never scored)."""
    return np.clip(np.floor((np.asarray(scores, np.float64) + 1.0) * (BINS / 2)), 0, BINS - 1).astype(np.int64)


def percentile_threshold(hist: np.ndarray, percentile: float) -> float:
    """The lower edge of the bin holding the ``percentile``-th percentile of a histogram's scores: rows below
    it are at most that share of the source."""
    n = int(hist.sum())
    if n == 0:
        return float("nan")
    b = int(np.searchsorted(np.cumsum(hist), percentile / 100.0 * n))
    return -1.0 + 2.0 * b / BINS


def aligned(left, right):
    """Pairs of equally long record batches from two streams of the same rows cut differently (their parts
    and row groups differ): each pair is the longest run both have buffered."""
    lb = rb = None
    left, right = iter(left), iter(right)
    while True:
        if lb is None or not lb.num_rows:
            lb = next(left, None)
        if rb is None or not rb.num_rows:
            rb = next(right, None)
        if lb is None or rb is None:
            if (lb is not None and lb.num_rows) or (rb is not None and rb.num_rows):
                raise ValueError("align: image_embeddings and samples have different row counts — rerun embed-images")
            return
        n = min(lb.num_rows, rb.num_rows)
        if n:
            yield lb.slice(0, n), rb.slice(0, n)
        lb, rb = lb.slice(n), rb.slice(n)


def _model(cfg: AlignConfig, task: TaskContext) -> tuple[str, str]:
    from ovpipe.inputs import upstream_config

    if cfg.model:
        return cfg.model, cfg.pretrained
    _, ecfg = upstream_config(task.run_dir, cfg.embeddings_step)
    return ecfg.model, ecfg.pretrained


def _partial_part(task: TaskContext, rank: int | None = None):
    return task.step_dir / "partials" / f"scores-{task.rank if rank is None else rank:05d}.parquet"


def score_slice(cfg: AlignConfig, task: TaskContext) -> None:
    """Map: this rank's canonical slice → scores (a partial ``alignment`` part, uncut) + per-source histograms."""
    import pyarrow as pa

    from curation.assign import NpyShards
    from curation.clip import load_clip
    from curation.concepts import embed_texts
    from manifests.io import PartWriter

    model, pretrained = _model(cfg, task)
    net, _, tokenizer, device = load_clip(model, pretrained, cfg.device)
    task.stats.info["device"] = device
    n_emb, n_smp = task.input_num_rows("image_embeddings"), task.input_num_rows("samples")
    if n_emb != n_smp:
        raise ValueError(f"align: image_embeddings has {n_emb} rows, its samples {n_smp} — embed-images writes one "
                         f"row per sample; rerun it")
    hists: dict[str, np.ndarray] = {}
    shards = NpyShards(task.run_dir)
    emb = task.iter_input_slice("image_embeddings", ["sample_id", "file", "row", "status"], batch_rows=cfg.batch_size)
    smp = task.iter_input_slice("samples", SAMPLE_COLUMNS, batch_rows=cfg.batch_size)
    path = _partial_part(task)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with PartWriter(path, "alignment") as out:
            for e, s in aligned(emb, smp):
                if e.column("sample_id") != s.column("sample_id"):
                    raise ValueError("align: image_embeddings and samples disagree row for row — rerun embed-images")
                rows = s.to_pylist()
                status = e.column("status").to_pylist()
                texts, kinds, scored = [], [None] * len(rows), []
                st = list(status)
                for j, r in enumerate(rows):
                    if status[j] != "ok":
                        continue
                    t, kinds[j], why = text_of(r, cfg.conversations)
                    if why:
                        st[j] = why
                    else:
                        texts.append(t)
                        scored.append(j)
                score = np.full(len(rows), np.nan, np.float32)
                error = [None] * len(rows)
                if scored:
                    files = e.column("file").to_numpy(zero_copy_only=False)[scored]
                    img = shards.gather(files, e.column("row").to_numpy()[scored], np.float32)
                    shards.release(keep=set(files.tolist()))
                    bad = bad_vectors(img)          # no cosine: the row gets its own status, the text is not embedded
                    for j in np.asarray(scored)[bad].tolist():
                        st[j], error[j] = BAD_VECTOR, BAD_VECTOR_ERROR
                    scored, img = [j for j, b in zip(scored, bad) if not b], img[~bad]
                    texts = [t for t, b in zip(texts, bad) if not b]
                if scored:
                    img /= np.linalg.norm(img, axis=1, keepdims=True)
                    with task.stats.timer("embed_text"):
                        txt = embed_texts(texts, ["{}"], net, tokenizer, device, cfg.batch_size)
                    score[scored] = (img * txt).sum(axis=1)
                    src = np.asarray([rows[j]["source"] or "" for j in scored], object)
                    b = score_bins(score[scored])
                    for name in np.unique(src):
                        h = hists.setdefault(str(name), np.zeros(BINS, np.int64))
                        h += np.bincount(b[src == name], minlength=BINS)
                for x in st:
                    task.stats.inc("scored" if x == "ok" else f"unscored/{x}")
                out.write(pa.table({
                    "sample_id": e.column("sample_id"), "source": s.column("source"),
                    "text_kind": pa.array([k if st[j] == "ok" else None for j, k in enumerate(kinds)], pa.string()),
                    "score": pa.array(score, mask=np.isnan(score)),
                    "threshold": pa.nulls(len(rows), pa.float32()),
                    "status": pa.array(st, pa.string()), "error": pa.array(error, pa.string())}))
    finally:
        shards.close()
    names = sorted(hists)
    task.write_partial("hist", sources=np.array(names, dtype=str),
                       hist=np.stack([hists[k] for k in names]) if names else np.zeros((0, BINS), np.int64))


def solve_thresholds(cfg: AlignConfig, task: TaskContext) -> None:
    """Reduce: per-source histograms summed → each source's threshold (``reduced/thresholds.npz``)."""
    total: dict[str, np.ndarray] = {}
    for part in task.iter_partials("hist"):
        for name, h in zip(part["sources"].tolist(), part["hist"]):
            total.setdefault(name, np.zeros(BINS, np.int64))
            total[name] += h
    names = sorted(total)
    if cfg.percentile is not None:
        cut = [percentile_threshold(total[k], cfg.percentile) for k in names]
    else:
        cut = [np.nan if cfg.threshold is None else cfg.threshold] * len(names)
    task.write_reduced("thresholds", sources=np.array(names, dtype=str), threshold=np.array(cut, np.float64),
                       hist=np.stack([total[k] for k in names]) if names else np.zeros((0, BINS), np.int64))
    task.stats.info["thresholds"] = {k: (None if np.isnan(c) else round(float(c), 6)) for k, c in zip(names, cut)}


def apply_cut(cfg: AlignConfig, task: TaskContext) -> None:
    """Apply: this rank's partial scores → its ``alignment`` part, ``low_alignment`` where below its source's cut."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    r = task.read_reduced("thresholds")
    cut = dict(zip(r["sources"].tolist(), r["threshold"].tolist()))
    partial = _partial_part(task)
    if not partial.exists():
        raise FileNotFoundError(f"{partial}: map rank {task.rank}'s scores are gone (the finalize removes them "
                                f"once every rank is applied) — rerun the step with --overwrite")
    with task.part_writer("alignment") as out:
        for b in pq.ParquetFile(partial).iter_batches(65_536):
            score = b.column("score").to_numpy(zero_copy_only=False).astype(np.float64)
            src = b.column("source").to_pylist()
            thr = np.array([cut.get(s or "", np.nan) for s in src], np.float64)
            thr[np.isnan(score)] = np.nan
            status = np.asarray(b.column("status").to_pylist(), object)
            low = (status == "ok") & ~np.isnan(thr) & (score < thr)
            status[low] = "low_alignment"
            for x, n in zip(*np.unique(status.astype(str), return_counts=True)):
                task.stats.inc(f"status/{x}", int(n))
            out.write(pa.table({**{k: b.column(k) for k in ("sample_id", "source", "text_kind", "score")},
                                "threshold": pa.array(thr.astype(np.float32), mask=np.isnan(thr)),
                                "status": pa.array(status, pa.string()), "error": b.column("error")}))


def write_report(cfg: AlignConfig, task: TaskContext) -> None:
    """Finalize: ``report.md`` (per source: scored, low_alignment, cut, quartiles) and ``scores.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = task.read_reduced("thresholds")
    files = "[" + ", ".join("'" + str(f).replace("'", "''") + "'" for f in task.output_files("alignment")) + "]"
    with task.duckdb() as con:
        rows = con.execute(f"""
            SELECT source, count(score) AS scored, count(*) FILTER (WHERE status = 'low_alignment') AS low,
                   any_value(threshold) FILTER (WHERE threshold IS NOT NULL) AS cut,
                   quantile_cont(score, [0.05, 0.25, 0.5, 0.75]) AS q
            FROM read_parquet({files}) GROUP BY source ORDER BY source""").fetchall()
    lines = ["# align: image–text CLIP score per source", "",
             "| source | scored | low_alignment | cut | p5 | p25 | median | p75 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for src, n, low, c, q in rows:
        qs = " | ".join(f"{v:.4f}" for v in q) if q and None not in q else "— | — | — | —"
        lines.append(f"| {src} | {n} | {low} | {'—' if c is None else f'{c:.4f}'} | {qs} |")
    plt.figure(figsize=(6, 4))
    centres = -1.0 + (np.arange(BINS) + 0.5) * 2.0 / BINS
    for name, h, c in zip(r["sources"].tolist(), r["hist"], r["threshold"].tolist()):
        if h.sum():
            nz = np.flatnonzero(h)
            lo, hi = nz[0], nz[-1] + 1
            step = max(1, (hi - lo) // 60)           # ≈ 60 bars a source
            agg = np.add.reduceat(h[lo:hi], np.arange(0, hi - lo, step))
            line = plt.step(centres[lo:hi:step], agg / h.sum(), where="post", label=name)[0]
            if not np.isnan(c):
                plt.axvline(c, ls="--", color=line.get_color(), lw=0.8)
    plt.xlabel("cos(image, text)")
    plt.ylabel("share of the source")
    plt.title("image–text alignment (dashed: the cut)")
    if plt.gca().get_legend_handles_labels()[0]:           # no source with a score: no legend
        plt.legend(fontsize=7)
    plt.tight_layout()
    plt.savefig(task.step_dir / "scores.png", dpi=110)
    plt.close()
    if cfg.planted:
        p = "'" + cfg.planted.replace("'", "''") + "'"
        with task.duckdb() as con:
            planted, found, low = con.execute(f"""
                SELECT count(*) FILTER (WHERE p.kind = 'mismatched_caption'),
                       count(*) FILTER (WHERE p.kind = 'mismatched_caption' AND a.status = 'low_alignment'),
                       (SELECT count(*) FROM read_parquet({files}) WHERE status = 'low_alignment')
                FROM read_parquet({p}) p LEFT JOIN read_parquet({files}) a USING (sample_id)""").fetchone()
        task.stats.info["planted_mismatched"] = {"planted": planted, "found": found, "low_alignment": low}
        lines += ["", f"Planted mismatched captions (demo): {found} of {planted} marked low_alignment "
                      f"({low} low_alignment rows in all)."]
    (task.step_dir / "report.md").write_text("\n".join(lines) + "\n\nPlot: scores.png\n")
    for rank in range(task.world_size):      # every rank is applied: the uncut scores are spent
        _partial_part(task, rank).unlink(missing_ok=True)


STEP = Step("align", AlignConfig, score_slice, reduce=solve_thresholds, apply=apply_cut, finalize=write_report,
            inputs={"image_embeddings": "embeddings_step", "samples": Input(via="embeddings_step")},
            outputs=("alignment",), check=check, description="image–text CLIP score per sample; low_alignment cut")
