"""``caption_source``: which caption a caption pair is trained on — the raw web alt-text, a VLM's
recaption (the ``captions`` manifest of the ``recaption`` step), or both.

    raw                  the ingested caption (the default; nothing is read)
    recaption:<lang>     each caption pair whose ``<lang>`` caption is ``ok`` becomes the recaptioned
                         pair ``[user "<image>" + recaption_prompts[lang], assistant recaption]``
    both[:<lang>]        raw and recaption (``en`` unless named), as ``both_as`` says:
                         ``two_samples`` — the raw pair as it is plus the recaptioned pair;
                         ``two_turns``   — one sample ``[user "<image>" + caption_prompt, assistant raw,
                                           user recaption_prompts[lang], assistant recaption]``

Only ``ok`` caption pairs (one image, ``[user "<image>", assistant caption]``) are touched; every other
row passes through. A caption pair with no ``ok`` caption in that language keeps its raw caption
(``missing_recaption: raw``, counted ``caption_source/raw_fallback``) or becomes a row with status
``no_recaption`` naming the caption's status (``missing_recaption: status``).

Lineage: a derived sample's ``sample_id`` is ``derived_sample_id(source id, turns)`` — xxh3-64 of a
NUL-prefixed tag, the source ``sample_id`` and the new conversation's canonical encoding, so it is
as stable as the source id (which already hashes the image bytes) and never collides with an
ingested id — and its ``source_sample_id`` (a ``lengths`` column) names the ingested sample.
``pack`` gives a derived sample the ``balanced`` / ``mixed`` copies of its source.
"""
from __future__ import annotations

from collections import Counter

DERIVED_PREFIX = b"\x00ovderived1\x00"


def parse(caption_source: str) -> tuple[str, str | None]:
    """``"raw"`` → ``("raw", None)``; ``"recaption:zh"`` → ``("recaption", "zh")``;
    ``"both"`` → ``("both", "en")``."""
    mode, _, lang = caption_source.partition(":")
    if mode == "raw" and not lang:
        return "raw", None
    if mode == "recaption" and lang:
        return mode, lang
    if mode == "both":
        return mode, lang or "en"
    raise ValueError(f"caption_source must be raw, recaption:<lang> or both[:<lang>], got {caption_source!r}")


def derived_sample_id(source_id: str, turns) -> str:
    import xxhash

    from manifests.conversation import canonical_bytes

    return xxhash.xxh3_64(DERIVED_PREFIX + source_id.encode() + canonical_bytes(turns)).hexdigest()


def read_recaptions(task, step: str, lang: str, sample_ids) -> dict[str, tuple[str, str]]:
    """``{sample_id: (status, caption)}`` of ``lang`` for the given ids: the ``captions`` manifest streamed
    a batch at a time, keeping only those rows (memory: the ids asked for, not the manifest)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from manifests.ids import id_member

    member = id_member(pc.unique(sample_ids))
    out = {}
    for b in task.iter_input_canonical("captions", ["sample_id", "lang", "caption", "status"], step=step):
        b = b.filter(pc.equal(b.column("lang"), lang))
        if b.num_rows:
            b = b.filter(pa.array(member(b.column("sample_id"))))
        for s, st, c in zip(*(b.column(k).to_pylist() for k in ("sample_id", "status", "caption"))):
            out[s] = (st, c)
    return out


def apply(task, table, cfg, count: bool = True):
    """``table`` (a ``samples`` slice with at least sample_id, status, conversation, images) → the
    same columns plus ``source_sample_id``, caption pairs rewritten as ``cfg.caption_source`` says
    (``cfg``: a ``LengthsConfig``). Rows keep their order; a ``two_samples`` row is followed by its
    derived sample."""
    import pyarrow as pa

    from manifests.conversation import IMAGE_TOKEN, is_caption_pair

    mode, lang = parse(cfg.caption_source)
    if mode == "raw":
        return table.append_column("source_sample_id", table.column("sample_id"))
    caps = read_recaptions(task, cfg.recaption_step, lang, table.column("sample_id").combine_chunks())
    prompt = cfg.recaption_prompts[lang]
    rows, counts = [], Counter()
    for r in table.to_pylist():
        r["source_sample_id"] = r["sample_id"]
        turns = [(t["role"], t["text"] or "") for t in (r["conversation"] or [])]
        if r["status"] != "ok" or not is_caption_pair(turns, len(r["images"] or [])):
            rows.append(r)
            continue
        status, recaption = caps.get(r["sample_id"], ("missing", None))
        if status != "ok":
            if cfg.missing_recaption == "status":
                counts["no_recaption"] += 1
                rows.append({**r, "status": "no_recaption",
                             "error": f"no ok {lang} recaption (captions status: {status})"})
            else:
                counts["raw_fallback"] += 1
                rows.append(r)
            continue
        counts["recaptioned"] += 1
        if mode == "both" and cfg.both_as == "two_turns":
            new = [("user", IMAGE_TOKEN + cfg.caption_prompt), turns[1], ("user", prompt), ("assistant", recaption)]
        else:
            new = [("user", IMAGE_TOKEN + prompt), ("assistant", recaption)]
            if mode == "both":
                rows.append(r)                # two_samples: the raw pair stays as it is
        rows.append({**r, "sample_id": derived_sample_id(r["sample_id"], new),
                     "conversation": [{"role": a, "text": b} for a, b in new], **({"caption": recaption}
                                                                                  if "caption" in r else {})})
    if count:
        for k, v in sorted(counts.items()):
            task.stats.inc(f"caption_source/{k}", v)
    schema = table.schema.append(pa.field("source_sample_id", pa.string()))
    return pa.Table.from_pylist(rows, schema=schema)
