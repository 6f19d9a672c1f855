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


def test_balance_sees_a_changed_assign(tmp_path, capsys):
    """assign's declared inputs (image_embeddings, concepts) and balance's (assignments): rerunning
    `assign` with another k makes the `balance` built on it refuse naming it, and status shows it stale."""
    run = tmp_path / "run"
    rng = np.random.default_rng(0)
    n, V, d = 200, 20, 8
    for step, kind, rows in (("embed-concepts", "concepts", V), ("embed-images", "image_embeddings", n)):
        x = rng.standard_normal((rows, d)).astype(np.float32)
        (run / step / "data").mkdir(parents=True)
        np.save(run / step / "data" / "v.npy", (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16))
        cols = {"file": [f"{step}/data/v.npy"] * rows, "row": np.arange(rows, dtype=np.int32)}
        if kind == "concepts":
            cols |= {"concept_id": np.arange(V, dtype=np.int32), "text": [f"c{i}" for i in range(V)]}
        else:
            cols |= {"sample_id": [f"{i:016x}" for i in range(n)], "status": ["ok"] * n, "error": [None] * n}
        write_part(cols, run / step / kind / "part-00000.parquet", kind)
    assign = ["assign", "--set", "backend=torch", "--run-dir", str(run), "--quiet"]
    balance = ["balance", "--set", "method=inverse_frequency", "--set", f"target_size={n}", "--run-dir", str(run),
               "--quiet"]
    assert main([*assign, "--set", "k=2"]) == 0
    assert sorted(json.loads((run / "assign" / "executor.json").read_text())["inputs"]) == [
        "embed-concepts", "embed-images"]
    assert main(balance) == 0
    assert main([*assign, "--set", "k=3", "--overwrite"]) == 0
    capsys.readouterr()
    assert main(balance) == 2
    assert "input step 'assign' was rerun with another config" in capsys.readouterr().err
    main(["status", str(run)])
    out = capsys.readouterr().out
    assert next(ln for ln in out.splitlines() if ln.startswith("balance ")).rstrip().endswith("stale")
    assert main([*balance, "--overwrite"]) == 0
    assert len(read_manifest(run, "assignments").column("concept_ids")[0]) == 3
