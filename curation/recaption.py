"""``recaption``: bilingual captions of the (balanced) corpus from a VLM, as a resumable batch step,
with quality checks as columns.

After concept balancing, the LLaVA-OneVision-1.5 recipe runs a strong captioner over the balanced set
and trains mid-training on its aligned English and Chinese descriptions instead of the raw web
alt-text. Input: the ok one-image samples of ``samples_steps`` (with ``only_balanced``: those with
``copies > 0`` in the ``balanced`` manifest), one request per (sample, language) with that language's
prompt from ``prompts``. Output: the ``captions`` manifest, one row per (sample_id, lang).

Backends — the one ``rollout`` uses (``inference.backends``): ``vllm`` (GPU, a chunk's requests in one
batched ``llm.generate``, images as ``multi_modal_data``), ``transformers`` (CPU/GPU, any Hugging Face
VLM folder, ovpipe's exported stage-2 folder included), ``file`` (captions produced elsewhere, JSONL rows
``{"sample_id", "lang", "caption", ["tokens"], ["finish_reason"], ["model"], ["error"]}``). Each request
is seeded from ``seed``, the sample id and the language, so a caption does not depend on the rank, the
task count or the chunk it ran in: outputs are deterministic (``temperature: 0``, the default, is greedy).

Resumable per rank, through the chunked-generation primitive ``rollout`` shares (``inference.chunked``):
the rank's samples, in ``sample_id`` order, are cut into chunks of ``chunk_size``; each chunk's rows are
written, atomically, to ``RUN/<step>/chunks/{rank:05d}/chunk-{k:06d}-{key}.parquet`` as soon as it is done
(``key``: a hash of the chunk's sample ids and of the config). A rank restarted after a kill or a Slurm
pre-emption keeps every chunk of its plan that is there and whole, and generates the missing ones, so a
pre-empted task loses at most one chunk (minutes), not the rank (hours). When the rank ends, its chunks —
consecutive ``sample_id`` ranges, each sorted — are streamed into its ``captions`` part; ranks already
complete are never redone (the executor's completion markers); ``finalize`` writes the report and removes
the chunks. What stays here: the prompts, a sample → its requests (one per language), the ``file``
backend's row → caption, and the statuses.

Memory: one chunk and a batch of input, not the slice (``docs/recaption.md``): the slice is chosen on the
input's light columns, its image addresses are streamed in ``sample_id`` order (``slice_samples``), and
the ``file`` backend (``inference.backends.CannedResponses``) holds the offsets of the rank's JSONL rows,
not the rows.

Quality checks (``quality``), first that applies wins, every one a ``status`` — nothing is dropped:

    error           the request failed (an image that does not decode, a caption missing from the file)
    empty           no text
    refused         matches a ``refusal_patterns`` regex ("I'm sorry", "I cannot", "抱歉", "我无法", ...)
    repetition      repeat_ratio = 1 − distinct/total n-grams (``repeat_ngram`` words; Han: characters)
                    above ``max_repeat_ratio`` — a decoding loop
    truncated       stopped at ``max_new_tokens`` (finish_reason ``length``)
    wrong_language  script_ratio (letters of the language's script in ``scripts`` / all letters, by
                    Unicode character name) below ``min_script_ratio``
    too_short       fewer than ``min_length[lang]`` units (Latin: words; Han: characters)
    ok

``script_ratio`` and ``repeat_ratio`` are columns too (NULL where undefined: no letters, fewer units
than the n-gram). The report (``RUN/<step>/report.md`` + ``caption_lengths.png``) gives the counts per
status and language, the caption-length histograms per language and a few examples per status.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from ovpipe.config import check_local_path, check_range, check_step_folder, looks_like_local_path
from inference.backends import check_backend_fields, check_backend_runtime
from ovpipe.inputs import Input
from ovpipe.step import Step, TaskContext, slice_bounds

DEFAULT_PROMPTS = {
    "en": "Describe this image in detail.",
    "zh": "请详细描述这张图片。",
}
# Letters counted as a language's script, by the start of their Unicode character name.
SCRIPT_NAMES = {"latin": ("LATIN",), "han": ("CJK UNIFIED IDEOGRAPH", "CJK COMPATIBILITY IDEOGRAPH")}
REFUSALS = [r"^\s*(i'?m sorry|i am sorry|sorry,|i cannot|i can'?t|i am unable|i'?m unable|as an ai)",
            r"^\s*(抱歉|很抱歉|对不起|我无法|我不能)"]
STATUSES = ("ok", "error", "empty", "refused", "repetition", "truncated", "wrong_language", "too_short")
_WORD = re.compile(r"\w+", re.UNICODE)
SAMPLE_BATCH_ROWS = 4096      # input rows decoded at once (sample_id + image address: a few hundred KB)
SELECT_BUCKET_ROWS = 1 << 16  # input rows per bucket the selection counts: a rank sorts its slice + two buckets


@dataclass
class RecaptionConfig:
    # the VLM engine: vllm (GPU), transformers, or a captions file
    backend: Literal["vllm", "transformers", "file"] = "transformers"
    model: str = ""                       # HF VLM folder or id (the demo: RUN/pretrain/hf-stage-2)
    file: str = ""                        # backend=file: the captions JSONL
    # the ingest step folder(s) whose caption pairs are recaptioned
    samples_steps: list[str] = field(default_factory=lambda: ["ingest"])
    only_balanced: bool = False           # only samples with copies > 0 in `balanced`
    balance_step: str = "balance"  # with only_balanced: the balance step folder
    limit: int = 0                        # > 0: the first `limit` input samples (canonical order) — demo slices
    prompts: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_PROMPTS))   # lang → prompt
    scripts: dict[str, str] = field(default_factory=lambda: {"en": "latin", "zh": "han"})  # lang → script
    max_new_tokens: int = 256  # the longest caption generated, in tokens
    temperature: float = 0.0              # 0 = greedy
    top_p: float = 1.0  # nucleus sampling (with temperature > 0)
    seed: int = 0  # the sampling seed
    chunk_size: int = 256                 # samples per written chunk (what a pre-empted task can lose)
    # quality checks
    refusal_patterns: list[str] = field(default_factory=lambda: list(REFUSALS))  # regexes: a match is a refusal
    repeat_ngram: int = 4  # the n-gram size of the repetition check
    max_repeat_ratio: float = 0.5  # above this share of repeated n-grams: a `repetitive` caption
    min_script_ratio: float = 0.5  # below this share of the language's script (latin, han): a `wrong_language` caption
    # lang → the fewest words (characters for zh) of a kept caption
    min_length: dict[str, int] = field(default_factory=lambda: {"en": 5, "zh": 10})
    report_examples: int = 3  # example captions per status in the report
    # transformers backend
    device: str = "auto"                  # transformers backend: auto is cuda when present, else cpu
    dtype: str = "auto"  # the transformers backend's weights dtype; auto: bf16 on a GPU, fp32 on a CPU
    cpu_threads: int = 0  # torch threads on a CPU; 0: torch's default
    vllm_engine_args: dict[str, Any] = field(default_factory=dict)  # vllm backend: more LLM(...) arguments, e.g.
                                  # {tensor_parallel_size: 2, model_impl: transformers, max_model_len: 8192}

    def __post_init__(self):
        if not self.prompts:
            raise ValueError("prompts: give at least one language → prompt")
        for lang, p in self.prompts.items():
            if not isinstance(p, str) or not p.strip():
                raise ValueError(f"prompts.{lang}: empty prompt")
            if self.scripts.get(lang) not in SCRIPT_NAMES:
                raise ValueError(f"scripts.{lang}: the script of language {lang!r}, one of {sorted(SCRIPT_NAMES)} "
                                 f"(got {self.scripts.get(lang)!r})")
            if lang not in self.min_length:
                raise ValueError(f"min_length.{lang}: the shortest acceptable caption for {lang!r}")
        check_backend_fields(self, "captions")
        if not self.samples_steps:
            raise ValueError("samples_steps must name at least one ingest step folder")
        for s in self.samples_steps:
            check_step_folder("samples_steps", s)
        check_step_folder("balance_step", self.balance_step)
        for i, pat in enumerate(self.refusal_patterns):
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"refusal_patterns[{i}]: {e}") from None
        check_range(self, "max_new_tokens", 1)
        check_range(self, "temperature", 0)
        check_range(self, "top_p", 0, 1, lo_open=True)
        check_range(self, "seed", 0)
        check_range(self, "limit", 0)
        check_range(self, "chunk_size", 1)
        check_range(self, "repeat_ngram", 1)
        check_range(self, "max_repeat_ratio", 0, 1)
        check_range(self, "min_script_ratio", 0, 1)
        check_range(self, "report_examples", 0)
        check_range(self, "cpu_threads", 0)
        for lang, n in self.min_length.items():
            if n < 0:
                raise ValueError(f"min_length.{lang} must be >= 0, got {n}")

    def check(self, run_dir: Path) -> None:
        """Before any work: a transformers that loads the remote code, the captions file, a local model
        folder (the inputs: ``STEP.inputs``)."""
        check_backend_runtime(self)
        if self.backend == "file":
            check_local_path("file", self.file)
        elif looks_like_local_path(self.model):
            check_local_path("model", self.model)

    def prompt_id(self, lang: str) -> str:
        import xxhash

        return f"{lang}:{xxhash.xxh3_64_hexdigest(self.prompts[lang].encode())[:8]}"


# --------------------------------------------------------------------------------- quality checks

def script_ratio(text: str, script: str) -> float | None:
    """Share of the letters of ``text`` whose Unicode name puts them in ``script``; None without letters."""
    names = SCRIPT_NAMES[script]
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return None
    return sum(unicodedata.name(c, "").startswith(names) for c in letters) / len(letters)


def units(text: str, script: str) -> list[str]:
    """What length and repetition are counted in: Han characters for ``han``, lowercased words else."""
    if script == "han":
        return [c for c in text if unicodedata.name(c, "").startswith(SCRIPT_NAMES["han"])]
    return [w.lower() for w in _WORD.findall(text)]


def repeat_ratio(u: list[str], n: int) -> float | None:
    """1 − distinct/total n-grams of ``u``; None when ``u`` has fewer than ``n`` units."""
    grams = [tuple(u[i:i + n]) for i in range(len(u) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else None


def quality(text: str, lang: str, finish_reason: str, error: str | None, cfg: RecaptionConfig,
            refusals: list[re.Pattern] | None = None) -> dict:
    """``{status, error, script_ratio, repeat_ratio}`` of one caption (see the module docstring)."""
    script = cfg.scripts[lang]
    text = text or ""
    sr = script_ratio(text, script) if text.strip() else None
    u = units(text, script)
    rr = repeat_ratio(u, cfg.repeat_ngram)
    out = {"script_ratio": sr, "repeat_ratio": rr, "error": None}
    refusals = refusals if refusals is not None else [re.compile(p, re.I) for p in cfg.refusal_patterns]
    if error is not None or finish_reason == "error":
        return {**out, "status": "error", "error": error or "generation failed"}
    if not text.strip():
        return {**out, "status": "empty", "error": "no text"}
    hit = next((p.pattern for p in refusals if p.search(text)), None)
    if hit:
        return {**out, "status": "refused", "error": f"matches refusal pattern {hit!r}"}
    if rr is not None and rr > cfg.max_repeat_ratio:
        return {**out, "status": "repetition",
                "error": f"{cfg.repeat_ngram}-gram repeat ratio {rr:.2f} > {cfg.max_repeat_ratio}"}
    if finish_reason == "length":
        return {**out, "status": "truncated", "error": f"stopped at max_new_tokens ({cfg.max_new_tokens})"}
    if sr is None or sr < cfg.min_script_ratio:
        return {**out, "status": "wrong_language",
                "error": f"{script} script ratio {'n/a' if sr is None else f'{sr:.2f}'} < {cfg.min_script_ratio}"}
    if len(u) < cfg.min_length[lang]:
        what = "character(s)" if script == "han" else "word(s)"
        return {**out, "status": "too_short", "error": f"{len(u)} {what} < {cfg.min_length[lang]}"}
    return {**out, "status": "ok"}


# ------------------------------------------------------------------------------------- the step

def _numbered_input_sql(task: TaskContext, cfg: RecaptionConfig) -> tuple[str, str, dict]:
    """SQL of every input row's ``sample_id``, ``status``, ``n_images`` and ``row``: its position in
    ``samples_steps``' rows concatenated, each step in canonical order exactly as ``task.iter_input`` gives
    it (``manifests.io.iter_parts``). A step whose parts lie in canonical order (judged from the footers, as
    the reader judges it: every ``ingest`` output) needs no sort: a row's position is the rows of the parts
    before its own plus its row in the part (DuckDB's ``file_index`` and ``file_row_number``). Any other
    step is numbered by the reader's own fallback sort: the sort keys, ties by part then row. Also the SQL
    of the input's ``status`` and ``n_images`` alone (the counters need no order), and the parameters."""
    import pyarrow.parquet as pq

    from manifests.io import parts_in_canonical_order
    from manifests.schemas import SORT_KEYS

    numbered, light, params, offset = [], [], {}, 0
    for k, step in enumerate(cfg.samples_steps):
        files = task.input_files("samples", step)
        starts = []
        for f in files:
            starts.append(offset)
            offset += pq.ParquetFile(f).metadata.num_rows
        params[f"files_{k}"] = [str(f) for f in files]
        if parts_in_canonical_order(files, "samples"):
            params[f"starts_{k}"] = starts
            row = f"list_extract(CAST($starts_{k} AS BIGINT[]), CAST(file_index AS BIGINT) + 1) + file_row_number"
        else:
            keys = ", ".join(f'"{c}"' for c in SORT_KEYS["samples"])
            row = f"{starts[0]} - 1 + row_number() OVER (ORDER BY {keys}, file_index, file_row_number)"
        numbered.append(f"SELECT sample_id, status, n_images, {row} AS row "
                        f"FROM read_parquet($files_{k}, file_row_number = true)")
        light.append(f"SELECT status, n_images FROM read_parquet($files_{k})")
    return " UNION ALL ".join(f"({q})" for q in numbered), " UNION ALL ".join(f"({q})" for q in light), params


def slice_rows(task: TaskContext, cfg: RecaptionConfig):
    """This rank's samples to caption as ``(ids, rows)``: their ``sample_id`` (an Arrow array, sorted) and
    their row numbers in ``samples_steps``' rows concatenated (each step in canonical order; ascending).
    ok, one image, (``only_balanced``) copies > 0, each ``sample_id`` once (its first row), the first
    ``limit`` — chosen over the whole input before slicing, so ranks get equal shares; ``slice_samples``
    then streams only this slice's image addresses.

    Memory follows the slice, not the corpus: the selection runs in DuckDB (``task.duckdb()``, under its
    memory limit, spilling under the step folder) on the light columns. Each ``sample_id`` keeps its first
    row (a grouped ``min``); the kept rows are counted per bucket of ``SELECT_BUCKET_ROWS`` input rows, and
    the rank fetches only the buckets holding its share ``[lo, hi)`` of them — its slice and at most two
    buckets more."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    with task.duckdb() as con:
        numbered, light, params = _numbered_input_sql(task, cfg)
        where = "status = 'ok' AND n_images = 1"
        if cfg.only_balanced:
            params["balanced"] = [str(f) for f in task.input_files("balanced", step=cfg.balance_step)]
            where += " AND sample_id IN (SELECT sample_id FROM read_parquet($balanced) WHERE copies > 0)"
        con.sql(f"CREATE TEMP TABLE kept AS SELECT sample_id, min(row) AS row, count(*) AS n "
                f"FROM ({numbered}) WHERE {where} GROUP BY sample_id", params=params)
        n_kept, n_selected = con.sql("SELECT count(*), coalesce(sum(n), 0) FROM kept").fetchall()[0]
        if task.rank == 0:
            files = {k: v for k, v in params.items() if k.startswith("files_")}
            n_rows, n_not_ok, n_not_one, n_ok_one = con.sql(
                f"SELECT count(*), count_if(status <> 'ok'), count_if(status = 'ok' AND n_images <> 1), "
                f"count_if(status = 'ok' AND n_images = 1) FROM ({light})", params=files).fetchall()[0]
            task.stats.inc("input/samples", n_rows)
            task.stats.inc("input/not_ok", n_not_ok)
            task.stats.inc("input/not_one_image", n_not_one)
            if cfg.only_balanced:
                task.stats.inc("input/not_balanced", n_ok_one - n_selected)
            if n_selected > n_kept:          # the same sample ingested twice (same image bytes, same text)
                task.stats.inc("input/duplicate_sample_ids", n_selected - n_kept)
        n = min(n_kept, cfg.limit) if cfg.limit else n_kept
        lo, hi = slice_bounds(n, task.rank, task.world_size)
        if lo >= hi:
            return pa.array([], pa.string()), np.zeros(0, np.int64)
        buckets = con.sql(f"SELECT row // {SELECT_BUCKET_ROWS} AS b, count(*) FROM kept GROUP BY b ORDER BY b").fetchall()
        before, first, last = 0, None, None          # kept rows before bucket `first`; the buckets holding [lo, hi)
        for b, c in buckets:
            if first is None and before + c > lo:
                first, skip = b, lo - before
            before += c
            if before >= hi:
                last = b
                break
        t = con.sql(f"SELECT sample_id, row FROM kept WHERE row >= {first * SELECT_BUCKET_ROWS} "
                    f"AND row < {(last + 1) * SELECT_BUCKET_ROWS} ORDER BY row").to_arrow_table()
    t = t.slice(skip, hi - lo)
    mine = t.column("sample_id").combine_chunks().cast(pa.string())
    rows = t.column("row").to_numpy().astype(np.int64)
    return mine.take(pc.sort_indices(mine)), rows


def slice_samples(task: TaskContext, cfg: RecaptionConfig, rows) -> Iterator[dict]:
    """The samples at ``rows`` (``slice_rows``) as ``{sample_id, image}`` in ``sample_id`` order, streamed.
    Each step's rows come in canonical order — by ``sample_id`` — so a heap merge of one stream per step
    gives the slice sorted while holding a batch per step, not the slice's addresses. A sample ingested
    twice is read at the row ``slice_rows`` kept, its first occurrence (``samples_steps`` order, then
    canonical); either copy has the same image bytes."""
    import heapq

    import numpy as np

    def step_samples(step: str, mine) -> Iterator[dict]:
        at = int(mine[0])              # the step's row number of the batch's first row
        for b in task.iter_input("samples", ["sample_id", "images"], step=step, lo=at, hi=int(mine[-1]) + 1,
                                 batch_rows=SAMPLE_BATCH_ROWS):
            take = mine[np.searchsorted(mine, at):np.searchsorted(mine, at + b.num_rows)] - at
            at += b.num_rows
            b = b.take(take)
            for sid, images in zip(b.column("sample_id").to_pylist(), b.column("images").to_pylist()):
                yield {"sample_id": sid, "image": images[0]}

    streams, offset = [], 0
    for step in cfg.samples_steps:
        n = task.input_num_rows("samples", step)
        mine = rows[(rows >= offset) & (rows < offset + n)] - offset
        if len(mine):
            streams.append(step_samples(step, mine))
        offset += n
    return heapq.merge(*streams, key=lambda s: s["sample_id"])


def canned_caption(rows: list[dict], sid: str, lang: str) -> dict:
    """backend=file: a caption from the first JSONL row of (sample_id, lang); none gives an error."""
    if not rows:
        return {"caption": "", "tokens": None, "finish_reason": "error", "model": None,
                "error": f"no caption for ({sid}, {lang}) in the file"}
    r = rows[0]
    tokens = r.get("tokens")
    return {"caption": str(r.get("caption") or ""), "tokens": int(tokens) if tokens is not None else None,
            "finish_reason": r.get("finish_reason") or ("error" if r.get("error") else "stop"),
            "model": r.get("model"), "error": r.get("error")}


def caption_chunk(samples: list[dict], cfg: RecaptionConfig, backend, task: TaskContext) -> list[dict]:
    """The captions rows of one chunk of samples (every language), quality checks applied."""
    from manifests.conversation import read_image
    from inference.backends import CannedResponses, Request, Sampling, seed_for

    langs = sorted(cfg.prompts)
    if isinstance(backend, CannedResponses):
        got = {(s["sample_id"], lang): canned_caption(backend.get((s["sample_id"], lang)), s["sample_id"], lang)
               for s in samples for lang in langs}
    else:
        reqs, keys, got = [], [], {}
        with task.stats.timer("read_images"):
            for s in samples:
                try:
                    img = read_image(s["image"])
                except Exception as e:      # a vanished shard: an error row per language
                    for lang in langs:
                        got[(s["sample_id"], lang)] = {"caption": "", "tokens": None, "finish_reason": "error",
                                                       "model": None, "error": f"image: {type(e).__name__}: {e}"}
                    continue
                for lang in langs:
                    parts = [{"type": "image"}, {"type": "text", "text": cfg.prompts[lang]}]
                    msg = [{"role": "user", "content": parts}]
                    reqs.append(Request(msg, [img], 1, seed_for(cfg.seed, f"{s['sample_id']}:{lang}")))
                    keys.append((s["sample_id"], lang))
        with task.stats.timer("generate"):
            gens = backend.generate(reqs, Sampling(cfg.temperature, cfg.top_p, cfg.max_new_tokens))
        for key, (g,) in zip(keys, gens):
            got[key] = {"caption": g.text, "tokens": g.tokens if g.error is None else None,
                        "finish_reason": g.finish_reason, "model": None, "error": g.error}
    refusals = [re.compile(p, re.I) for p in cfg.refusal_patterns]
    rows = []
    for (sid, lang), g in sorted(got.items()):
        q = quality(g["caption"], lang, g["finish_reason"], g["error"], cfg, refusals)
        rows.append({"sample_id": sid, "lang": lang, "caption": g["caption"], "model": g["model"] or cfg.model or None,
                     "backend": cfg.backend, "prompt_id": cfg.prompt_id(lang), "tokens": g["tokens"],
                     "finish_reason": g["finish_reason"], **q})
    return rows


def run(cfg: RecaptionConfig, task: TaskContext) -> None:
    from inference.backends import CannedResponses, load_for
    from inference.chunked import ChunkedGeneration, config_fingerprint

    ids, rows = slice_rows(task, cfg)
    chunks = ChunkedGeneration(task, "captions", ids, cfg.chunk_size, config_fingerprint(cfg),
                               want_ids=cfg.backend == "file")
    backend = None
    if chunks.todo:
        if cfg.backend == "file":
            want, langs = chunks.todo_ids, set(cfg.prompts)
            backend = CannedResponses(cfg.file, lambda r: (r.get("sample_id"), r.get("lang"))
                                      if r.get("sample_id") in want and r.get("lang") in langs else None,
                                      task.stats, first_only=True)
        else:
            backend = load_for(cfg, task.stats, max_images=1)
    try:
        chunks.generate(lambda: slice_samples(task, cfg, rows), lambda s: caption_chunk(s, cfg, backend, task),
                        id_field="sample_id", unit="samples")
    finally:
        if isinstance(backend, CannedResponses):
            backend.close()

    def count(t) -> None:
        for lang, status in zip(t.column("lang").to_pylist(), t.column("status").to_pylist()):
            task.stats.inc(f"status/{lang}/{status}")

    n = chunks.write_part(count)
    task.stats.inc("samples", len(ids))
    task.stats.inc("captions", n)


def finalize(cfg: RecaptionConfig, task: TaskContext) -> None:
    from curation.recaption_report import recaption_report
    from inference.chunked import remove_chunks

    recaption_report(cfg, task)
    remove_chunks(task)               # every rank's part is written


STEP = Step("recaption", RecaptionConfig, run, outputs=("captions",), finalize=finalize,
            inputs={"samples": "samples_steps", "balanced": Input("balance_step", when=lambda c: c.only_balanced)},
            check=RecaptionConfig.check,
            description="bilingual VLM captions of the (balanced) corpus, resumable, with quality checks")
