"""A step with more ranks than the cluster's ``MaxArraySize``: submitted as several arrays whose indices stay below
it (``ovpipe.executors.slurm.array_chunks``), each task adding its chunk's offset back. The cluster test lowers
``MaxArraySize`` to 2 on the loopback cluster, so 3 ranks are 2 chunks of each array phase."""
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from slurm_cluster import SlurmCluster  # noqa: E402

from ovpipe.executors.slurm import (  # noqa: E402
    array_chunks, chain_status, chunk_workers, describe_chain, render_launch_script, SlurmOptions)
from ovpipe.cli import main  # noqa: E402


def test_chunks_keep_every_index_below_the_limit():
    assert array_chunks(list(range(1500)), 1001) == [(0, list(range(1001))), (1001, list(range(1001, 1500)))]
    # a rerun of ranks 1200-1499: one array, indices 0-299, not a refused 1200-1499
    assert array_chunks(list(range(1200, 1500)), 1001) == [(1200, list(range(1200, 1500)))]
    # holes are kept: every rank is in exactly one chunk, and its index (rank - offset) is below the limit
    ranks = [0, 1, 2, 5, 9, 10, 11, 12, 30]
    chunks = array_chunks(ranks, 4)
    assert [r for _, part in chunks for r in part] == ranks
    assert all(0 <= r - off < 4 for off, part in chunks for r in part)
    assert [off for off, _ in chunks] == [0, 5, 9, 30]
    # below the limit nothing moves: a rerun of rank 2 is index 2, as before there were chunks
    assert array_chunks([2], 1001) == [(0, [2])]
    # the throttle is shared among the chunks, not one --workers per chunk
    assert chunk_workers(8, [1001, 499]) == [5, 2]
    assert chunk_workers(8, [3, 2]) == [8, 8]
    assert chunk_workers(2, [1]) == [2]
    assert chunk_workers(1, [3, 3, 1]) == [1, 1, 1]


def test_launch_script_passes_the_offset_to_the_task(tmp_path):
    text = render_launch_script("ingest", tmp_path, 1500, list(range(1200, 1500)), 4, SlurmOptions(), "python",
                                offset=1200)
    assert "#SBATCH --array=0-299%4" in text
    assert "RANK_OFFSET=1200" in text
    assert '--rank "$((SLURM_ARRAY_TASK_ID + RANK_OFFSET))" --world-size 1500' in text
    # the offset is what bash adds back: index 299 of this chunk is rank 1499
    line = next(ln for ln in text.splitlines() if ln.startswith("RANK_OFFSET="))
    shell = f"{line}; SLURM_ARRAY_TASK_ID=299; echo $((SLURM_ARRAY_TASK_ID + RANK_OFFSET))"
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1499"


def test_status_of_a_chunked_chain(tmp_path):
    """squeue's task ids are the chunk's indices: rank = offset + index, per chunk."""
    sdir = tmp_path / "step"
    (sdir / "completions").mkdir(parents=True)
    (sdir / "completions" / "00000").touch()
    record = {"ranks": [0, 1, 2, 3, 4], "chain": [
        {"phase": "map", "job": "12", "after": [], "offset": 0, "ranks": [0, 1, 2]},
        {"phase": "map", "job": "13", "after": [], "offset": 3, "ranks": [3, 4]},
        {"phase": "merge", "job": "14", "after": ["12", "13"]}]}
    rows = [("12", "1", "RUNNING", "None"), ("12", "2", "PENDING", "JobArrayTaskLimit"),
            ("13", "0", "RUNNING", "None"), ("13", "1", "PENDING", "JobArrayTaskLimit"),
            ("14", "", "PENDING", "Dependency")]
    st = chain_status(sdir, record, rows=rows)
    assert [(s["job"], s["done"], s["running"], s["pending"]) for s in st] == [
        ("12", [0], [1], [2]), ("13", [], [3], [4]), ("14", [], [], [0])]
    assert describe_chain(st) == (
        "map 12 [ranks 0-2] running 1/3 (1 running, 1 pending), map 13 [ranks 3-4] running 0/2 (1 running, "
        "1 pending) → merge 14 pending (afterok:12:13)")


def _ingest(demo, run, *extra):
    return main(["ingest", "--set", f'inputs=["{demo}/shards/*.tar"]', "--set", "source=demo",
                 "--run-dir", str(run), "--tasks", "3", "--workers", "4", "--quiet", *extra])


def _outputs(run: Path) -> dict[str, bytes]:
    """Every file the step wrote but its logs, stats and the executor's own records."""
    sdir = run / "ingest"
    return {str(p.relative_to(sdir)): p.read_bytes() for p in sorted(sdir.rglob("*"))
            if p.is_file() and p.suffix in (".parquet", ".npz", ".npy", ".jsonl")
            and not {"logs", "stats", "completions", "failures"} & set(p.relative_to(sdir).parts)}


@pytest.mark.slurm
def test_step_past_max_array_size_matches_a_local_run(demo_corpus, tmp_path, monkeypatch):
    """3 ranks under MaxArraySize=2 (indices 0-1): sbatch refused ``--array=0-2`` before the chunks. Now the map
    and the apply phase are 2 arrays each, the reduce and the merge ``afterok`` on both, the outputs the local
    run's bytes, and ``ovpipe status`` names every chunk."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert _ingest(demo_corpus, ref) == 0
    with SlurmCluster(max_array_size=2) as cluster:
        monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
        assert _ingest(demo_corpus, run, "--executor", "slurm", "--wait") == 0
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["status", str(run)]) == 0
    sdir = run / "ingest"
    rec = json.loads((sdir / "slurm_jobs.json").read_text())
    chain = [(j["phase"], j.get("offset"), j.get("ranks"), j["after"]) for j in rec["chain"]]
    maps, applies = rec["arrays"], rec["apply_arrays"]
    assert len(maps) == len(applies) == 2
    assert chain == [("map", 0, [0, 1], []), ("map", 2, [2], []),
                     ("reduce", None, None, maps),
                     ("apply", 0, [0, 1], [rec["reduce"]]), ("apply", 2, [2], [rec["reduce"]]),
                     ("merge", None, None, applies)]
    assert "#SBATCH --array=0%" in (sdir / "launch_script.1.slurm").read_text()
    assert "RANK_OFFSET=2" in (sdir / "launch_apply.1.slurm").read_text()
    assert (sdir / "completions" / "finalized").exists()
    assert _outputs(run) and _outputs(run) == _outputs(ref)
    status = out.getvalue()
    for job in (*maps, *applies):
        assert f" {job} [ranks " in status, status
    assert "map " + maps[0] + " [ranks 0-1] done 2/2" in status and "[ranks 2] done 1/1" in status
    line = next(ln for ln in status.splitlines() if "slurm:" in ln)
    assert not any(w in line for w in ("failed", "pending", "running")), line


def test_the_submit_line_shows_chunks_side_by_side():
    from ovpipe.executors.slurm import describe_jobs

    record = {"chain": [{"phase": "map", "job": "12", "after": [], "offset": 0, "ranks": list(range(1001))},
                        {"phase": "map", "job": "13", "after": [], "offset": 1001, "ranks": list(range(1001, 1500))},
                        {"phase": "merge", "job": "14", "after": ["12", "13"]}]}
    assert describe_jobs(record) == "map 12 [ranks 0-1000], map 13 [ranks 1001-1499] → merge 14 (afterok:12:13)"
    one = {"chain": [{"phase": "map", "job": "12", "after": ["9"], "offset": 0, "ranks": [0, 1]},
                     {"phase": "merge", "job": "13", "after": ["12"]}]}
    assert describe_jobs(one) == "map 12 (afterok:9) → merge 13 (afterok:12)"
