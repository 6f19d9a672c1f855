"""``pack-official``: a ``pack`` step's bins → the same packs in the official LLaVA-OneVision-1.5 layout
(``packing.official``), the dataset its trainer (``aiak_training_llm``) reads, plus the ``official_packs``
manifest: one row per sub-sample, with its status and its token count under the official encoding.

Every pack of ``pack_step`` becomes one entry, its sub-samples in pack order: ``img{i}.jpg`` and the aligned
``prompts[i]`` (the user turn, ``caption_prompt`` appended to a bare ``<image>`` as ``lengths`` trains it)
and ``captions[i]`` (the assistant turn). A sub-sample the flavour cannot carry — text-only, several
images, several turns or a system turn (``packing.official.carry_status``) — is left out of the entry and
keeps a row with that status (counted ``status/<status>``); a pack with none left writes no entry.

Exact lengths: every written sub-sample is re-encoded the way the official task encoder does
(``official_encode``) and must come to ``lengths − tail`` tokens (the rule in ``packing.official``), and
every entry's sum must fit ``seq_len``; either failing stops the task naming the sample, so a dataset this
step completed is one the official trainer loads without a length assertion. A pack step with the default
``count_for: ovpipe`` made its bins with ovpipe's counts, ``tail`` tokens per sub-sample longer, so they fit
with that much room to spare; one with ``count_for: llava-ov`` filled them to ``seq_len`` under the official
count. ``finalize`` reports the fill, official tokens / (entries × ``seq_len``), as the ``official_fill``
counter (the summary line's ``fill``).

Work split: ranks take whole shards of ``pack_step`` (``pack.shard_bounds``); shard ``j`` becomes
``data/pack-{j:06d}.tar`` with the same packs, so the output is byte-identical for any task count.
``finalize`` runs energon's own ``prepare`` over the tars and writes the official ``dataset.yaml`` and
``sample_loader.py`` (``packing.official.write_meta``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ovpipe.config import check_step_folder
from ovpipe.inputs import Input
from ovpipe.step import Step, TaskContext


@dataclass
class PackOfficialConfig:
    pack_step: str = "pack"     # the pack step folder whose bins are written

    def __post_init__(self):
        check_step_folder("pack_step", self.pack_step)

    def check(self, run_dir: Path) -> None:
        """Before any work: the pack step wrote shards (its packs' samples are what this step follows)."""
        from ovpipe.inputs import upstream_config
        from packing.pack import STEP as PACK

        if (Path(run_dir) / self.pack_step / "config.json").is_file() and \
                not upstream_config(run_dir, self.pack_step, PACK)[1].write_shards:
            raise ValueError(f"pack_step: {self.pack_step!r} ran with write_shards: false — re-run it with shards")


def run(cfg: PackOfficialConfig, task: TaskContext) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    from ovpipe.inputs import upstream_config
    from packing.lengths import STEP as LENGTHS
    from packing.pack import STEP as PACK, needed_samples, shard_bounds
    from packing.tokens import load_tokenizer

    pcfg = upstream_config(task.run_dir, cfg.pack_step, PACK)[1]
    lcfg = upstream_config(task.run_dir, pcfg.lengths_step, LENGTHS)[1]
    lo, hi = shard_bounds(task.input_num_rows("packs"), pcfg.packs_per_shard, task.rank, task.world_size)
    packs = [b for b in task.iter_input("packs", ["pack_id", "sample_ids", "lengths", "shard"], lo=lo, hi=hi)]
    packs = pa.Table.from_batches(packs) if packs else None
    with task.part_writer("official_packs") as out:
        if packs is None or not packs.num_rows:
            return
        ids = pc.unique(packs.column("sample_ids").combine_chunks().flatten())
        # the ingested rows these samples come from (a recaptioned sample names its source), one streamed pass
        sources = [b.filter(pc.is_in(b.column("sample_id"), value_set=ids)).column("source_sample_id")
                   for b in task.iter_input("lengths", ["sample_id", "source_sample_id"], step=pcfg.lengths_step)]
        rows = needed_samples(task, lcfg, set(ids.to_pylist()),
                              pa.chunked_array([s for s in sources if len(s)], pa.string()))
        tok = load_tokenizer(lcfg.tokenizer)
        writer = OfficialWriter(task, pcfg, lcfg, tok, rows)
        for p in packs.to_pylist():
            out.write(writer.add(p))
        writer.flush()


class OfficialWriter:
    """Official entries, a shard at a time: each pack's carriable sub-samples re-encoded and checked."""

    def __init__(self, task: TaskContext, pcfg, lcfg, tok, rows: dict):
        from packing.official import tail_tokens

        self.task, self.pcfg, self.lcfg, self.tok, self.rows = task, pcfg, lcfg, tok, rows
        self.img_cfg = lcfg.image_cfg()
        self.tail = tail_tokens(tok)
        self.entries, self.shard = [], None

    def add(self, p: dict):
        import pyarrow as pa

        from manifests.conversation import read_image
        from manifests.schemas import schema_for
        from packing.official import carry_status, entry, official_encode
        from packing.tokens import prompted_turns

        if self.shard is not None and p["shard"] != self.shard:
            self.flush()
        self.shard = p["shard"]
        prompts, captions, names, images, out = [], [], [], [], []
        total = 0
        for slot, (sid, want) in enumerate(zip(p["sample_ids"], p["lengths"])):
            r = self.rows.get(sid)
            if r is None:
                raise RuntimeError(f"sample {sid}: no ok row in the samples manifests of {self.lcfg.samples_steps} — "
                                   f"were the ingest steps re-run after `{self.pcfg.lengths_step}`?")
            addrs = r["images"] or []
            turns = prompted_turns([(t["role"], t["text"] or "") for t in r["conversation"]], len(addrs),
                                   self.lcfg.caption_prompt)
            status, tokens = carry_status(turns, len(addrs)), None
            if status == "ok":
                (_, prompt), (_, caption) = turns
                ids, _ = official_encode(self.tok, prompt, caption, (addrs[0]["height"], addrs[0]["width"]),
                                         self.img_cfg)
                tokens = len(ids)
                if tokens != want - self.tail:
                    raise RuntimeError(f"sample {sid}: the official encoding gives {tokens} tokens, but lengths says "
                                       f"{want} and the rule says {want - self.tail} (tail {self.tail}) — tokenizer or "
                                       f"template changed since `{self.pcfg.lengths_step}` ran?")
                total += tokens
                prompts.append(prompt)
                captions.append(caption)
                names.append(sid)
                images.append(read_image(addrs[0]))
            self.task.stats.inc(f"status/{status}")
            out.append({"pack_id": p["pack_id"], "slot": slot, "sample_id": sid, "ovpipe_tokens": want,
                        "official_tokens": tokens, "shard": p["shard"] if status == "ok" else None,
                        "status": status, "error": None if status == "ok" else f"{len(addrs)} image(s), "
                        f"{len(turns)} turn(s): a PackedCaptioningSample holds one image and one prompt/answer"})
        if total > self.pcfg.seq_len:
            raise RuntimeError(f"pack {p['pack_id']}: {total} tokens under the official encoding > seq_len "
                               f"{self.pcfg.seq_len}")
        if images:   # else every sub-sample was refused: rows, no entry
            self.entries.append(entry(f"{p['pack_id']:012d}", prompts, captions, names, images))
            self.task.stats.inc("packs_written")
            self.task.stats.inc("official_tokens", total)
        return pa.Table.from_pylist(out, schema=schema_for("official_packs"))

    def flush(self) -> None:
        from packing.official import write_shard

        if self.entries:
            write_shard(self.task.data_path(self.shard), self.entries)
        self.entries = []


def finalize(cfg: PackOfficialConfig, task: TaskContext) -> None:
    """Energon's own ``prepare`` over the tars (split, index), then the official ``dataset.yaml`` and
    ``sample_loader.py`` (energon's CLI writes no dataset.yaml for a sample type outside its package)."""
    from packing.energon import prepare
    from packing.official import write_meta

    n_shards = len(list(task.step_dir.glob("data/pack-*.tar")))
    if n_shards:
        with task.stats.timer("energon_prepare"):
            prepare(task.step_dir, n_shards, task.step_dir / "logs" / "energon_prepare.log", sample_type=None)
        write_meta(task.step_dir)
    tokens, entries = official_fill(task)
    if entries:     # no entry: the fill is undefined, no counter
        from ovpipe.inputs import upstream_config
        from packing.pack import STEP as PACK

        seq_len = upstream_config(task.run_dir, cfg.pack_step, PACK)[1].seq_len
        task.stats.inc("official_fill", round(tokens / (entries * seq_len), 6))


def official_fill(task: TaskContext) -> tuple[int, int]:
    """(official tokens, entries written) from the ``official_packs`` parts, a part's two columns at a time (a
    rank's part holds whole packs, so the entries are counted per part)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    tokens = entries = 0
    for f in task.output_files("official_packs"):
        t = pq.read_table(f, columns=["pack_id", "official_tokens", "status"])
        t = t.filter(pc.equal(t.column("status"), "ok"))
        tokens += int(pc.sum(t.column("official_tokens")).as_py() or 0)
        entries += int(pc.count_distinct(t.column("pack_id")).as_py())
    return tokens, entries


INPUTS = {
    "packs": "pack_step",
    "lengths": Input(via="pack_step"),
    "samples": Input(via="pack_step"),
    "captions": Input(via="pack_step"),
}

STEP = Step("pack-official", PackOfficialConfig, run, inputs=INPUTS, outputs=("official_packs",),
            finalize=finalize, check=PackOfficialConfig.check, description="a pack step's bins in the official LLaVA-OV-1.5 layout")

