"""``dedup``'s report (its finalize): what near-duplicate removal found and what it does to the balance.

``RUN/dedup/report.md``: images removed per ε (the step's ε and ``report_eps``, each its own greedy keep
over the same clusters), the clusters, and — with ``concepts_from`` — removals per concept, counted the
way ``balance`` counts (every one of an image's top-K concepts), for the concepts that lose most.
``RUN/dedup/pairs.png``: a contact sheet of example pairs (kept | removed, cosine), spread over the
range of cosines found. Everything is read by DuckDB from the manifests, a few rows at a time.
"""
from __future__ import annotations

import io

import numpy as np


def _files(task, kind: str, own: bool = False) -> str:
    files = task.output_files(kind) if own else task.input_files(kind)
    return "[" + ", ".join("'" + str(f).replace("'", "''") + "'" for f in files) + "]"


def example_pairs(task, n: int) -> list[dict]:
    """Up to ``n`` near_duplicate rows spread evenly over their cosine order (ties: sample_id), with both
    samples' image addresses."""
    if n <= 0:
        return []
    with task.duckdb() as con:
        rows = con.sql(f"""
            WITH d AS (SELECT sample_id, duplicate_of, similarity,
                              row_number() OVER (ORDER BY similarity, sample_id) - 1 AS i,
                              count(*) OVER () AS n
                       FROM read_parquet({_files(task, 'dedup', own=True)}) WHERE status = 'near_duplicate'),
                 pick AS (SELECT * FROM d WHERE n <= {n} OR i IN
                          (SELECT CAST(floor(g * (n - 1) / {max(n - 1, 1)}) AS BIGINT) FROM range({n}) t(g)))
            SELECT p.sample_id, p.duplicate_of, p.similarity, s1.images AS images, s1.width * s1.height AS area,
                   s2.images AS kept_images, s2.width * s2.height AS kept_area
            FROM pick p
            JOIN read_parquet({_files(task, 'samples')}) s1 ON s1.sample_id = p.sample_id AND s1.status = 'ok'
            JOIN read_parquet({_files(task, 'samples')}) s2 ON s2.sample_id = p.duplicate_of AND s2.status = 'ok'
            ORDER BY p.similarity, p.sample_id""").to_arrow_table().to_pylist()
    return rows


def contact_sheet(pairs: list[dict], path, thumb: int = 96) -> None:
    """Kept | removed thumbnails, one pair a row, the cosine and sizes under them (PIL)."""
    from PIL import Image, ImageDraw

    from manifests.conversation import read_image, upright_rgb

    pad, text_h = 6, 14
    sheet = Image.new("RGB", (2 * thumb + 3 * pad, max(1, len(pairs)) * (thumb + text_h + pad) + pad), "white")
    draw = ImageDraw.Draw(sheet)
    for r, p in enumerate(pairs):
        y = pad + r * (thumb + text_h + pad)
        for c, addr in enumerate((p["kept_images"][0], p["images"][0])):
            try:
                with Image.open(io.BytesIO(read_image(addr))) as im:
                    t = upright_rgb(im).copy()
                t.thumbnail((thumb, thumb))
                sheet.paste(t, (pad + c * (thumb + pad), y))
            except Exception as e:  # noqa: BLE001 — a missing image is drawn as its error, not a failed report
                draw.text((pad + c * (thumb + pad), y), type(e).__name__, fill="red")
        draw.text((pad, y + thumb + 1), f"cos {p['similarity']:.4f}  {p['kept_area']} px | {p['area']} px",
                  fill="black")
    sheet.save(path)


def removals_per_concept(task, top: int = 15):
    """(rows of concept_id, text, images, removed, removed_share) for the ``top`` concepts losing most,
    and the total number of concepts losing any) — from ``assignments`` × ``dedup``."""
    with task.duckdb() as con:
        con.execute(f"""CREATE TEMP TABLE per AS
            SELECT c AS concept_id, count(*) AS images, count(*) FILTER (WHERE d.status = 'near_duplicate') AS removed
            FROM (SELECT sample_id, unnest(concept_ids) AS c FROM read_parquet({_files(task, 'assignments')})) a
            JOIN read_parquet({_files(task, 'dedup', own=True)}) d USING (sample_id) GROUP BY 1""")
        rows = con.execute(f"""
            SELECT p.concept_id, k.text, p.images, p.removed, round(p.removed / p.images, 4) AS removed_share
            FROM per p LEFT JOIN read_parquet({_files(task, 'concepts')}) k USING (concept_id)
            WHERE p.removed > 0 ORDER BY p.removed DESC, p.concept_id LIMIT {top}""").fetchall()
        losing = con.execute("SELECT count(*) FROM per WHERE removed > 0").fetchone()[0]
    return rows, int(losing)


def planted_found(planted: str, task) -> list[str]:
    """The demo's planted copies (``demo.corpus.plant_cases``): per kind, how many were marked as a duplicate of
    their original (or the original of them), and the near_duplicate pairs that are not planted ones."""
    p = "'" + str(planted).replace("'", "''") + "'"
    d = _files(task, "dedup", own=True)
    with task.duckdb() as con:
        rows = con.execute(f"""
            SELECT p.kind, count(*) AS planted,
                   count(*) FILTER (WHERE (a.status = 'near_duplicate' AND a.duplicate_of = p.original)
                                       OR (o.status = 'near_duplicate' AND o.duplicate_of = p.sample_id)) AS found
            FROM read_parquet({p}) p LEFT JOIN read_parquet({d}) a ON a.sample_id = p.sample_id
                 LEFT JOIN read_parquet({d}) o ON o.sample_id = p.original
            WHERE p.original IS NOT NULL GROUP BY p.kind ORDER BY p.kind""").fetchall()
        other = con.execute(f"""
            SELECT count(*) FROM read_parquet({d}) x WHERE x.status = 'near_duplicate' AND NOT EXISTS (
                SELECT 1 FROM read_parquet({p}) p
                WHERE (p.sample_id = x.sample_id AND p.original = x.duplicate_of)
                   OR (p.original = x.sample_id AND p.sample_id = x.duplicate_of))""").fetchone()[0]
    found = sum(r[2] for r in rows)
    marked = found + int(other)
    task.stats.info["planted"] = {k: {"planted": n, "found": f} for k, n, f in rows}
    task.stats.info["planted_precision"] = round(found / marked, 4) if marked else None
    return ["Planted near-duplicates (demo): found = marked as a duplicate of their original (or it of them).", "",
            "| kind | planted | found |", "| --- | ---: | ---: |", *[f"| {k} | {n} | {f} |" for k, n, f in rows],
            "", f"Other near_duplicate rows (not a planted pair): {other}; precision on the planted pairs: "
                f"{found}/{marked}."]


def write_report(cfg, task) -> None:
    r = task.read_reduced("dedup")
    images = int(r["images"][0])
    lines = [f"# dedup: semantic near-duplicates ({images} images with a vector, {int(r['clusters'][0])} clusters, "
             f"largest {int(r['largest'][0])})", "",
             "| ε | cosine > | removed | share |", "| ---: | ---: | ---: | ---: |"]
    for e, n in zip(r["eps"].tolist(), r["removed"].tolist()):
        mark = " (the step's)" if abs(e - cfg.eps) < 1e-12 else ""
        lines.append(f"| {e:g}{mark} | {1 - e:.4g} | {n} | {n / images if images else float('nan'):.4f} |")
    pairs = example_pairs(task, cfg.report_pairs)
    if pairs:
        contact_sheet(pairs, task.step_dir / "pairs.png")
        lines += ["", f"Example pairs (kept | removed, spread over the cosines found): pairs.png ({len(pairs)})"]
    if cfg.concepts_from:
        rows, losing = removals_per_concept(task)
        task.stats.info["concepts_losing_images"] = losing
        lines += ["", f"Removals per concept (every top-K concept of a removed image counts, as in balance; "
                  f"{losing} concepts lose images; the {len(rows)} losing most):", "",
                  "| concept | text | images | removed | share |", "| ---: | --- | ---: | ---: | ---: |"]
        lines += [f"| {c} | {t} | {n} | {m} | {s:.4f} |" for c, t, n, m, s in rows]
    if cfg.planted:
        lines += ["", *planted_found(cfg.planted, task)]
    (task.step_dir / "report.md").write_text("\n".join(lines) + "\n")
    task.stats.info["removed"] = int(r["removed"][list(np.round(r["eps"], 10)).index(round(cfg.eps, 10))])
