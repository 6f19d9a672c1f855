"""A changed upstream is seen through every input a step reads, not only the one it packs: rerunning
`mix` or `balance` with another config makes the `pack` built on it refuse (or, with --overwrite,
rebuild) naming the changed step, and `ovpipe status` shows it stale."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from manifests import read_manifest
from manifests.io import write_part
from ovpipe.cli import main


@pytest.fixture(scope="module")
def lengths_run(ingested_run, tmp_path_factory):
    """ingest → tokenizer → lengths (2 tasks): what both packs below start from."""
    from packing.tiny_tokenizer import main as build_tok

    run = tmp_path_factory.mktemp("stale")
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    assert build_tok(["--out", str(run / "tokenizer"), "--run-dir", str(run)]) == 0
    assert main(["lengths", "--set", f"tokenizer={run / 'tokenizer'}", "--set", "seq_len=1024",
                 "--run-dir", str(run), "--tasks", "2", "--quiet"]) == 0
    return run


def _pack(run, *extra):
    return main(["pack", "--set", "seq_len=1024", "--set", "packs_per_shard=8", *extra, "--run-dir", str(run),
                 "--quiet"])


def _packed_copies(run) -> int:
    return sum(len(p["sample_ids"]) for p in read_manifest(run, "packs", step="pack").to_pylist())


def _assert_pack_refuses_then_rebuilds(run, capsys, changed: str, extra: list[str], copies: int):
    capsys.readouterr()
    # the old behaviour was "already done (same config)" with the packs of the old copies
    assert _pack(run, *extra) == 2
    err = capsys.readouterr().err
    assert f"input step {changed!r} was rerun with another config" in err and "--overwrite" in err
    # status: pack is finished but stale, naming the changed input; its other steps are current
    main(["status", str(run)])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("pack "))
    assert line.rstrip().endswith("stale")
    assert f"stale: input step {changed!r} was rerun with another config" in out
    assert not any(ln.startswith("lengths ") and ln.rstrip().endswith("stale") for ln in out.splitlines())
    # --overwrite rebuilds it on the new copies; then it is current and a rerun is a no-op
    assert _pack(run, *extra, "--overwrite") == 0
    assert _packed_copies(run) == copies
    main(["status", str(run)])
    out = capsys.readouterr().out
    assert "stale:" not in out and not any(ln.rstrip().endswith("stale") for ln in out.splitlines())
    assert _pack(run, *extra) == 0


def test_pack_sees_a_changed_mix(lengths_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lengths_run, run)
    mix = ["mix", "--set", "inputs=[ingest]", "--set", "by=source", "--set", "rest=1.0", "--run-dir", str(run),
           "--quiet"]
    assert main([*mix, "--set", "size=100"]) == 0
    extra = ["--set", "copies_from=mixed"]
    assert _pack(run, *extra) == 0
    assert _packed_copies(run) == 100
    # the pack records every folder it read: lengths, mix and (for its shards) the samples lengths read
    assert sorted(json.loads((run / "pack" / "executor.json").read_text())["inputs"]) == ["ingest", "lengths", "mix"]
    assert main([*mix, "--set", "size=50", "--overwrite"]) == 0
    assert int(np.sum(read_manifest(run, "mixed").column("copies").to_numpy())) == 50
    _assert_pack_refuses_then_rebuilds(run, capsys, "mix", extra, 50)


def test_pack_sees_a_changed_balance(lengths_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lengths_run, run)
    # concept assignments for the ingested samples, written by hand (an external input of balance)
    ids = [r["sample_id"] for r in read_manifest(run, "samples").to_pylist() if r["status"] == "ok"]
    rng = np.random.default_rng(0)
    write_part({"sample_id": ids, "concept_ids": [list(r) for r in rng.integers(0, 20, (len(ids), 2))],
                "scores": [[0.5, 0.4]] * len(ids)}, run / "assign" / "assignments" / "part-00000.parquet",
               "assignments")
    write_part({"concept_id": np.arange(20, dtype=np.int32), "text": [f"c{i}" for i in range(20)],
                "file": ["x"] * 20, "row": np.arange(20, dtype=np.int32)},
               run / "embed-concepts" / "concepts" / "part-00000.parquet", "concepts")
    balance = ["balance", "--set", "method=inverse_frequency", "--run-dir", str(run), "--quiet"]
    assert main([*balance, "--set", f"target_size={2 * len(ids)}"]) == 0
    extra = ["--set", "copies_from=balanced", "--set", "write_shards=false"]
    assert _pack(run, *extra) == 0
    assert _packed_copies(run) == int(np.sum(read_manifest(run, "balanced").column("copies").to_numpy()))
    assert main([*balance, "--set", f"target_size={len(ids) // 2}", "--overwrite"]) == 0
    half = int(np.sum(read_manifest(run, "balanced").column("copies").to_numpy()))
    _assert_pack_refuses_then_rebuilds(run, capsys, "balance", extra, half)


def test_a_read_the_step_does_not_declare_is_refused(tmp_path):
    from ovpipe.step import TaskContext
    from packing.pack import STEP, PackConfig

    task = TaskContext.for_step(STEP, PackConfig(copies_from="none"), tmp_path)
    assert sorted(task.inputs) == ["captions", "lengths", "samples"]
    with pytest.raises(ValueError, match="does not declare"):
        task.read_input("mixed")
    with pytest.raises(ValueError, match="do not resolve"):
        task.read_input("lengths", step="lengths-other")
