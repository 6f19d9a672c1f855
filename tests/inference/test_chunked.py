"""The chunked-generation primitive (``inference.chunked``) on its own, over a stand-in generator: a kill
mid-chunk redoes only that chunk, a done chunk is never regenerated (nor its items read), a chunk planned
for other items or another config is, a file cut short is, the two passes over the input must agree, the
part has the bytes of one write of every row whatever the chunking, cleanup leaves no chunk file, and a
task's memory follows its chunk, not its slice."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from inference.chunked import ChunkedGeneration, chunk_path, config_fingerprint, remove_chunks
from manifests.io import write_part
from ovpipe.step import TaskContext

FP = "cfg-a"


def ids_of(n):
    return [f"{i * 0x9E3779B1 % 2**32:08x}" for i in range(n)]      # not in sorted order: the given order counts


def items_of(ids):
    return [{"prompt_id": i, "question": f"q{i}"} for i in ids]


def rows_for(items):
    return [{"prompt_id": p["prompt_id"], "rollout_idx": j, "prompt_type": "answer_only",
             "response": f"{p['question']}/{j}", "tokens": j, "backend": "stub", "model": None, "sampling": "{}"}
            for p in items for j in range(2)]


def task_at(run, rank=0):
    return TaskContext(step="gen", rank=rank, world_size=1, run_dir=run)


def run_once(run, ids, chunk=3, fp=FP, generate=None, items=None):
    """One try of a rank: plan, generate the to-do chunks, write the part. Returns (plan, generated chunks)."""
    task = task_at(run)
    c = ChunkedGeneration(task, "rollouts", ids, chunk, fp)
    calls = []

    def gen(chunk_items):
        calls.append([p["prompt_id"] for p in chunk_items])
        return (generate or rows_for)(chunk_items)

    c.generate(items if items is not None else (lambda: items_of(ids)), gen, id_field="prompt_id")
    c.write_part()
    return c, calls, task


def test_fresh_run_writes_each_chunk_once_and_the_part_is_one_write(tmp_path):
    ids = ids_of(10)
    c, calls, task = run_once(tmp_path / "a", ids)
    assert c.n_chunks == 4 and [len(x) for x in calls] == [3, 3, 3, 1] and sum(calls, []) == ids
    assert task.stats.counters["chunks/written"] == 4 and task.stats.counters["chunks/resumed"] == 0
    # a slice in its sort order: the part has the bytes of one sorted write of every row, for any chunk size
    ordered = sorted(ids)
    one = write_part(rows_for(items_of(ordered)), tmp_path / "one.parquet", "rollouts", sort=True)
    for chunk in (1, 4, 7, 10, 64):
        _, _, t = run_once(tmp_path / f"c{chunk}", ordered, chunk=chunk)
        assert t.part_path("rollouts").read_bytes() == one.read_bytes(), chunk


def test_kill_mid_chunk_redoes_only_that_chunk(tmp_path):
    run, ids = tmp_path / "r", ids_of(10)

    def dies_in_chunk_2(items):
        if items[0]["prompt_id"] == ids[6]:
            raise KeyboardInterrupt("pre-empted mid-chunk")
        return rows_for(items)

    with pytest.raises(KeyboardInterrupt):
        run_once(run, ids, generate=dies_in_chunk_2)
    task = task_at(run)
    names = sorted(p.name[:12] for p in task.chunk_dir().glob("chunk-*"))
    assert names == ["chunk-000000", "chunk-000001"]                   # chunk 2 left nothing behind
    c, calls, task = run_once(run, ids)
    assert calls == [ids[6:9], ids[9:]]                                  # only the chunk in flight, and the rest
    assert task.stats.counters["chunks/resumed"] == 2 and task.stats.counters["chunks/written"] == 2
    _, _, ref = run_once(tmp_path / "ref", ids)
    assert task.part_path("rollouts").read_bytes() == ref.part_path("rollouts").read_bytes()


def test_a_done_chunk_is_never_regenerated_nor_its_items_read(tmp_path):
    run, ids = tmp_path / "r", ids_of(9)
    run_once(run, ids)
    before = {p: p.stat().st_mtime_ns for p in task_at(run).chunk_dir().glob("chunk-*")}

    def never(*a):
        raise AssertionError("called")

    c, calls, task = run_once(run, ids, generate=never, items=never)
    assert calls == [] and c.todo == set() and task.stats.counters["chunks/resumed"] == 3
    assert {p: p.stat().st_mtime_ns for p in task.chunk_dir().glob("chunk-*")} == before
    # the stream stops after the last chunk to do: a done tail is not read
    (task.chunk_dir() / sorted(p.name for p in before)[0]).unlink()
    seen = []

    def stream():
        for p in items_of(ids):
            seen.append(p["prompt_id"])
            yield p

    _, calls, _ = run_once(run, ids, items=stream)
    assert calls == [ids[:3]] and seen == ids[:3]


def test_other_items_or_config_regenerate_and_stale_chunks_go(tmp_path):
    run, ids = tmp_path / "r", ids_of(9)
    run_once(run, ids)
    changed = ids[:4] + ["ffffffff"] + ids[5:]                            # chunk 1's items changed
    _, calls, task = run_once(run, changed)
    assert calls == [changed[3:6]] and task.stats.counters["chunks/stale_removed"] == 1
    assert len(list(task.chunk_dir().glob("chunk-*"))) == 3
    _, calls, task = run_once(run, changed, fp="cfg-b")                    # another model / prompt / sampling
    assert len(calls) == 3 and task.stats.counters["chunks/stale_removed"] == 3


def test_config_fingerprint_covers_every_field():
    from dataclasses import dataclass

    @dataclass
    class C:
        model: str = "m"
        temperature: float = 1.0

    assert config_fingerprint(C()) != config_fingerprint(C(temperature=0.5)) != config_fingerprint(C(model="n"))
    assert config_fingerprint(C()) == config_fingerprint(C())


def test_a_chunk_cut_short_or_of_another_schema_is_redone(tmp_path):
    run, ids = tmp_path / "r", ids_of(9)
    c, _, task = run_once(run, ids)
    p0, p1 = c.paths[0], c.paths[1]
    p0.write_bytes(p0.read_bytes()[: p0.stat().st_size // 2])              # lost its footer
    write_part([], p1, "selection")                                         # another manifest's schema
    tmp = task.chunk_dir() / f".tmp-1-{c.paths[2].name}"                    # a killed writer's temp file
    tmp.write_bytes(b"half")
    _, calls, task = run_once(run, ids)
    assert calls == [ids[:3], ids[3:6]]


def test_the_two_passes_must_agree(tmp_path):
    ids = ids_of(7)
    with pytest.raises(RuntimeError, match="not the ones planned"):
        run_once(tmp_path / "a", ids, items=lambda: items_of(ids[:3] + ["00000000"] + ids[4:]))
    with pytest.raises(RuntimeError, match="ended in chunk"):
        run_once(tmp_path / "b", ids, items=lambda: items_of(ids[:5]))


def test_cleanup_leaves_no_chunk_files(tmp_path):
    run = tmp_path / "r"
    for rank in (0, 1):
        task = task_at(run, rank)
        c = ChunkedGeneration(task, "rollouts", ids_of(5), 2, FP)
        c.generate(lambda: items_of(ids_of(5)), rows_for, id_field="prompt_id")
        c.write_part()
    assert len(list((run / "gen" / "chunks").rglob("chunk-*"))) == 6
    remove_chunks(task_at(run))
    assert not (run / "gen" / "chunks").exists()
    assert sorted(p.name for p in (run / "gen" / "rollouts").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]


def test_empty_slice(tmp_path):
    c, calls, task = run_once(tmp_path / "r", [])
    assert c.n_chunks == 0 and calls == [] and task.part_path("rollouts").exists()


def test_chunk_path_names_k_and_key(tmp_path):
    assert chunk_path(tmp_path, 7, "abc").name == "chunk-000007-abc.parquet"


MEASURE = r"""
import json, sys
from pathlib import Path
import numpy, pyarrow, pyarrow.parquet, xxhash, tqdm   # not the task's memory
import manifests.io, inference.chunked
from inference.chunked import ChunkedGeneration
from ovpipe.mapreduce import vmhwm_bytes
from ovpipe.step import TaskContext

run, n = Path(sys.argv[1]), int(sys.argv[2])
PAD = "x" * 2048

def ids():
    return (f"{i:08d}" for i in range(n))

def items():
    return ({"prompt_id": i, "image": PAD * 4} for i in ids())       # 8 KB of input per item

def gen(chunk):
    return [{"prompt_id": p["prompt_id"], "rollout_idx": j, "prompt_type": "answer_only", "response": f"{j}{PAD}",
             "tokens": j, "backend": "stub", "model": None, "sampling": "{}"} for p in chunk for j in range(4)]

base = vmhwm_bytes()
task = TaskContext(step="gen", rank=0, world_size=1, run_dir=run)
c = ChunkedGeneration(task, "rollouts", ids(), 64, "fp")
c.generate(items, gen, id_field="prompt_id")
rows = c.write_part()
assert rows == 4 * n
print(json.dumps({"delta": vmhwm_bytes() - base}))
"""


def _peak_mib(run: Path, n: int) -> float:
    r = subprocess.run([sys.executable, "-c", MEASURE, str(run), str(n)], capture_output=True, text=True,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["delta"] / 2 ** 20


def test_memory_follows_the_chunk_not_the_slice(tmp_path):
    """1,000 and 8,000 items (8 KB of input each, four 2 KB rows out): 8 → 64 MB of input, 8 → 64 MB of rows;
    the task's peak resident memory grows by far less than the slice does."""
    small, large = _peak_mib(tmp_path / "small", 1000), _peak_mib(tmp_path / "large", 8000)
    print(f"VmHWM added by a chunked generation, MiB: 1,000 items {small:.1f}; 8,000 items {large:.1f}")
    assert large - small < 12, (small, large)
