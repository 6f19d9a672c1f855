"""User errors become one line on stderr and exit code 2, before any work (config errors).

Each test reproduces a drill that used to exit 0 with wrong output, fail only at task time,
write outside the run folder, or end in a raw traceback.
"""
import os
import shutil
import stat
from pathlib import Path

import pytest

from ovpipe.cli import main
from ovpipe.config import ConfigError, load_config


@pytest.fixture(autouse=True)
def _inputs_exist(tmp_path_factory, monkeypatch):
    """`inputs=[x.tar]` names a file that exists (in a working folder of its own), so each test
    reaches the check it is about rather than ingest's own "matches no file" pre-start check."""
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "x.tar").write_bytes(b"")
    monkeypatch.chdir(cwd)


def _run(capsys, *argv) -> tuple[int, str]:
    """rc and stderr of ``ovpipe *argv`` (argparse errors exit via SystemExit)."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


def _one_clear_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    for n in needles:
        assert n in last, (n, err)


# --- lengths: sizes that gave wrong token counts are refused, naming the field -----------------

@pytest.mark.parametrize("field, value", [
    ("batch_size", -1),      # was: exit 0 with every text_tokens = 0
    ("batch_size", 0),       # was: every image counts 2 tokens
    ("patch_size", 0), ("merge_size", 0),
    ("patch_size", -14), ("merge_size", -2), ("min_pixels", -1),
])
def test_lengths_bad_sizes_refused_before_work(tmp_path, capsys, field, value):
    run = tmp_path / "run"
    rc, err = _run(capsys, "lengths", "--set", "tokenizer=Qwen/Qwen3-4B", "--set", f"{field}={value}",
                   "--run-dir", run)
    assert rc == 2
    _one_clear_line(err, field, str(value))
    assert not run.exists()


# --- every value-carrying field of the step configs has a range check naming it ----------------

RANGE_CASES = [
    ("packing.lengths", "LengthsConfig", {"tokenizer": "t", "seq_len": 10}, "seq_len"),
    ("packing.lengths", "LengthsConfig", {"tokenizer": "t", "max_pixels": 10}, "max_pixels"),
    ("packing.lengths", "LengthsConfig", {"tokenizer": "t", "samples_steps": ["../ingest"]}, "samples_steps"),
    ("packing.pack", "PackConfig", {"seed": -1}, "seed"),
    ("packing.pack", "PackConfig", {"packs_per_shard": 0}, "packs_per_shard"),
    ("packing.pack", "PackConfig", {"report_buffers": [64, 0]}, "report_buffers"),
    ("packing.pack", "PackConfig", {"report_max_samples": 0}, "report_max_samples"),
    ("packing.pack", "PackConfig", {"refine_passes": -1}, "refine_passes"),
    ("packing.pack", "PackConfig", {"lengths_step": "/tmp/x"}, "lengths_step"),
    ("curation.mix", "MixConfig", {"size": 0}, "size"),
    ("curation.mix", "MixConfig", {"size": 5, "rest": 1.0, "seed": -3}, "seed"),
    ("curation.mix", "MixConfig", {"size": 5, "rest": 1.0, "inputs": ["a/b"]}, "inputs"),
    ("curation.embed", "EmbedImagesConfig", {"batch_size": 0}, "batch_size"),
    ("curation.embed", "EmbedImagesConfig", {"samples_step": ".."}, "samples_step"),
    ("curation.concepts", "EmbedConceptsConfig", {"vocabulary": "v.txt", "batch_size": 0}, "batch_size"),
    ("curation.assign", "AssignConfig", {"k": 0}, "k"),
    ("curation.concept_balance", "BalanceConfig", {"count_top": 0}, "count_top"),
    ("curation.concept_balance", "BalanceConfig", {"seed": -1}, "seed"),
    ("curation.concept_balance", "BalanceConfig", {"alpha": float("nan")}, "alpha"),
    ("curation.demo_clip", "DemoClipConfig", {"ground_truth": "g", "vocabulary": "v", "lr": 0}, "lr"),
    ("curation.demo_clip", "DemoClipConfig", {"ground_truth": "g", "vocabulary": "v", "k": 0}, "k"),
    ("curation.demo_clip", "DemoClipConfig", {"ground_truth": "g", "vocabulary": "v", "threads": 0}, "threads"),
    ("rl_select.export", "ExportConfig", {"format_ratio": -0.5}, "format_ratio"),
    ("rl_select.ingest", "RLIngestConfig", {"inputs": ["x"], "max_images": -1}, "max_images"),
    ("rl_select.rollout", "RolloutConfig", {"model": "m", "top_p": 0}, "top_p"),
    ("rl_select.rollout", "RolloutConfig", {"model": "m", "temperature": -1}, "temperature"),
    ("rl_select.rollout", "RolloutConfig", {"model": "m", "max_new_tokens": 0}, "max_new_tokens"),
    ("rl_select.score", "ScoreConfig", {"rollouts_step": "a/../b"}, "rollouts_step"),
    ("rl_select.select", "SelectConfig", {"min_gap": 2}, "min_gap"),
]


@pytest.mark.parametrize("module, cls, data, field", RANGE_CASES,
                         ids=[f"{c[1]}.{c[3]}" for c in RANGE_CASES])
def test_step_config_range_checks_name_the_field(module, cls, data, field):
    import importlib

    config_cls = getattr(importlib.import_module(module), cls)
    with pytest.raises(ConfigError, match=field):
        load_config(config_cls, data)


# --- task and worker counts --------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--tasks", 0), ("--tasks", -2), ("--workers", 0), ("--workers", -1)])
def test_tasks_and_workers_must_be_positive(tmp_path, capsys, flag, value):
    # was: --tasks 0 exited 0 having done nothing; --tasks -2 ended in a traceback
    run = tmp_path / "run"
    rc, err = _run(capsys, "ingest", "--set", "inputs=[x.tar]", "--run-dir", run, flag, value)
    assert rc == 2
    _one_clear_line(err, flag, ">= 1")
    assert not run.exists()


# --- config file and run folder problems: one line, exit 2 ------------------------------------

def test_yaml_syntax_error_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("inputs: [a.tar\nsource: demo\n")
    rc, err = _run(capsys, "ingest", "--config", cfg, "--run-dir", tmp_path / "run")
    assert rc == 2
    _one_clear_line(err, str(cfg), "not valid YAML", "line")


def test_missing_config_file_is_one_line(tmp_path, capsys):
    rc, err = _run(capsys, "ingest", "--config", tmp_path / "nope.yaml", "--run-dir", tmp_path / "run")
    assert rc == 2
    _one_clear_line(err, "nope.yaml", "not found")


def test_bad_set_value_is_one_line(tmp_path, capsys):
    rc, err = _run(capsys, "ingest", "--set", "inputs=[a.tar", "--run-dir", tmp_path / "run")
    assert rc == 2
    _one_clear_line(err, "--set inputs")
    rc, err = _run(capsys, "ingest", "--set", "inputs", "--run-dir", tmp_path / "run")
    assert rc == 2
    _one_clear_line(err, "FIELD=VALUE")


def test_run_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    rc, err = _run(capsys, "ingest", "--set", "inputs=[x.tar]", "--run-dir", f)
    assert rc == 2
    _one_clear_line(err, "not a folder")
    rc, err = _run(capsys, "ingest", "--set", "inputs=[x.tar]", "--run-dir", f / "sub")
    assert rc == 2
    _one_clear_line(err, "cannot write")


def test_read_only_run_dir_is_one_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    if os.geteuid() == 0:  # root ignores permissions: make every mkdir under the run fail as EACCES would
        real_mkdir = Path.mkdir

        def mkdir(self, *a, **k):
            if str(self).startswith(str(run)) and self != run:
                raise PermissionError(13, "Permission denied", str(self))
            return real_mkdir(self, *a, **k)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    else:
        run.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        rc, err = _run(capsys, "ingest", "--set", "inputs=[x.tar]", "--run-dir", run)
    finally:
        run.chmod(0o755)
    assert rc == 2
    _one_clear_line(err, "cannot write", "Permission denied")


def test_debug_flag_shows_the_traceback(tmp_path, capsys):
    argv = ["ingest", "--config", str(tmp_path / "nope.yaml"), "--run-dir", str(tmp_path / "run")]
    with pytest.raises(Exception, match="not found"):
        main(["--debug", *argv])
    with pytest.raises(Exception, match="not found"):
        main([*argv, "--debug"])


def test_unexpected_error_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    import ovpipe.runfolder.prepare as rf

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(rf, "prepare", boom)
    rc, err = _run(capsys, "ingest", "--set", "inputs=[x.tar]", "--run-dir", tmp_path / "run")
    assert rc == 1
    _one_clear_line(err, "RuntimeError: disk on fire", "--debug")


# --- checked before any work: tokenizer path, upstream manifests -------------------------------

def test_missing_tokenizer_path_fails_before_work(ingested_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    for tok in ("./no-such-tokenizer", str(tmp_path / "no" / "tok")):
        rc, err = _run(capsys, "lengths", "--set", f"tokenizer={tok}", "--run-dir", run)
        assert rc == 2
        _one_clear_line(err, "tokenizer", "does not exist")
        assert not (run / "lengths").exists()


def test_hub_names_are_not_paths():
    from ovpipe.config import looks_like_local_path

    assert not looks_like_local_path("Qwen/Qwen3-4B")
    assert not looks_like_local_path("gpt2")
    assert looks_like_local_path("./tok") and looks_like_local_path("/models/tok")
    assert looks_like_local_path("runs/demo/tokenizer")


@pytest.mark.parametrize("argv, needle", [
    (["lengths", "--set", "tokenizer=Qwen/Qwen3-4B", "--set", "samples_steps=[llava]"], "samples_steps names 'llava'"),
    (["lengths", "--set", "tokenizer=Qwen/Qwen3-4B", "--set", "samples_steps=[ingest, other]"], "'other'"),
    (["pack"], "lengths_step names 'lengths'"),
    (["pack", "--set", "copies_from=mixed"], "'mixed' manifest"),
    (["pack", "--set", "copies_from=balanced"], "'balanced' manifest"),
    (["mix", "--set", "size=10", "--set", "rest=1.0", "--set", "inputs=[ingest, llava]"], "inputs names 'llava'"),
    (["embed-images", "--set", "samples_step=llava"], "samples_step names 'llava'"),
    (["score"], "'rollouts' manifest"),
])
def test_missing_upstream_manifest_fails_before_work(ingested_run, tmp_path, capsys, argv, needle):
    run = tmp_path / "run"
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    if argv[0] == "pack":  # a lengths folder, so only the copies manifest is missing
        (run / "lengths" / "lengths").mkdir(parents=True)
        shutil.copy(next((run / "ingest" / "samples").glob("part-*.parquet")),
                    run / "lengths" / "lengths" / "part-00000.parquet")
        if argv == ["pack"]:
            shutil.rmtree(run / "lengths")
    before = sorted(p.name for p in run.iterdir())
    rc, err = _run(capsys, *argv, "--run-dir", run)
    assert rc == 2
    _one_clear_line(err, "cannot start", needle)
    assert sorted(p.name for p in run.iterdir()) == before  # no step folder made


# --- --name stays inside the run folder --------------------------------------------------------

@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", "/tmp/x", ""])
def test_name_must_be_one_path_component(tmp_path, capsys, name):
    run = tmp_path / "run"
    rc, err = _run(capsys, "ingest", "--set", "inputs=[x.tar]", "--run-dir", run, "--name", name)
    assert rc == 2
    _one_clear_line(err, "--name")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- reruns: a changed config names the field; a done step in a read-only run is a no-op ------

def _ingest_argv(demo_corpus, run, *extra):
    return ["ingest", "--set", f'inputs=["{demo_corpus}/shards/*.tar"]', "--set", "source=demo",
            "--run-dir", str(run), "--tasks", "2", "--quiet", *extra]


def test_changed_config_refusal_names_the_field(demo_corpus, ingested_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    rc, err = _run(capsys, *_ingest_argv(demo_corpus, run, "--set", "verify=full", "--set", "source=other"))
    assert rc == 2
    _one_clear_line(err, "config changed", 'source: "demo" → "other"',
                    'verify: "header" → "full"', "--overwrite")


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def test_done_step_in_read_only_run_is_a_noop(demo_corpus, ingested_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    before = _snapshot(run)
    # chmod -R a-w; as root permissions are not enforced, so the snapshot below is what proves
    # that nothing was written.
    for p in [run, *run.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        rc, err = _run(capsys, *_ingest_argv(demo_corpus, run))
        assert rc == 0, err
        assert "Traceback" not in err
        assert _snapshot(run) == before
    finally:
        for p in [run, *run.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    rc = main(_ingest_argv(demo_corpus, run)[:-1])  # not --quiet: says it was already done
    assert rc == 0 and "already done" in capsys.readouterr().out


def test_ingest_inputs_matching_no_file_fail_before_work(tmp_path, capsys):
    from ovpipe.cli import main

    rc = main(["ingest", "--set", f'inputs=["{tmp_path}/nothing/*.tar"]', "--run-dir", str(tmp_path / "run"), "--quiet"])
    assert rc == 2
    assert "matches no file" in capsys.readouterr().err
    assert not (tmp_path / "run" / "ingest").exists()


# --- issue 66: errors that stop a bad run before it costs anything -----------------------------------


def test_a_missing_pretrained_path_fails_before_any_task(ingested_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    rc, err = _run(capsys, "embed-images", "--run-dir", run, "--set", "model=ovpipe-tiny-clip",
                   "--set", f"pretrained={tmp_path}/nope/tiny-clip.pt")
    assert rc == 2
    _one_clear_line(err, "cannot start", "pretrained", "nope/tiny-clip.pt", "does not exist")
    assert sorted(p.name for p in run.iterdir()) == ["ingest"]        # no task started, no step folder


def test_an_unknown_model_name_gets_a_short_did_you_mean(ingested_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    vocab = tmp_path / "concepts.txt"
    vocab.write_text("cat\n")
    for argv in (["embed-images"], ["embed-concepts", "--set", f"vocabulary={vocab}"]):
        rc, err = _run(capsys, *argv, "--run-dir", run, "--set", "model=ViT-H-14-quickgel")
        assert rc == 2, err
        _one_clear_line(err, "model: 'ViT-H-14-quickgel'", "did you mean 'ViT-H-14-quickgelu'")
        assert len(err) < 400 and "RN50" not in err                      # not open_clip's list of every name


def test_a_bad_set_value_is_reported_as_set_not_as_the_config_file(tmp_path, capsys):
    cfg = tmp_path / "lengths.yaml"
    cfg.write_text("tokenizer: Qwen/Qwen3-4B\n")
    rc, err = _run(capsys, "lengths", "--config", cfg, "--run-dir", tmp_path / "run", "--set", "seq_len=12")
    assert rc == 2
    _one_clear_line(err, "--set seq_len: seq_len must be >= 64")
    assert str(cfg) not in err
    rc, err = _run(capsys, "lengths", "--config", cfg, "--run-dir", tmp_path / "run", "--set", "seq_lenn=1024")
    _one_clear_line(err, "--set seq_lenn", "did you mean 'seq_len'")


def test_pack_refuses_a_seq_len_other_than_its_lengths_steps(tmp_path, capsys):
    import json

    from ovpipe.config import config_json
    from packing.lengths import LengthsConfig

    run = tmp_path / "run"
    (run / "lengths" / "lengths").mkdir(parents=True)
    (run / "lengths" / "config.json").write_text(config_json(LengthsConfig(tokenizer="Qwen/Qwen3-4B", seq_len=1024)))
    (run / "lengths" / "executor.json").write_text(json.dumps({"step": "lengths", "outputs": ["lengths"]}))
    rc, err = _run(capsys, "pack", "--run-dir", run, "--set", "seq_len=8192")
    assert rc == 2
    _one_clear_line(err, "cannot start", "seq_len: 8192", "seq_len 1024", "'lengths'")
    assert not (run / "pack").exists()


@pytest.mark.parametrize("argv, writer", [
    (["lengths", "--set", "tokenizer=Qwen/Qwen3-4B"], "`ovpipe ingest`"),
    (["pack"], "`ovpipe lengths`"),
    (["score"], "`ovpipe rollout`"),
    (["embed-images", "--set", "samples_step=[ingest-EN, ingest-CN]"], "`ovpipe ingest` (`--name ingest-EN`)"),
])
def test_a_missing_input_names_the_step_that_writes_it(tmp_path, capsys, argv, writer):
    rc, err = _run(capsys, *argv, "--run-dir", tmp_path / "run")
    assert rc == 2
    _one_clear_line(err, "cannot start", f"run {writer}")


def test_status_of_a_folder_that_does_not_exist_fails(tmp_path, capsys):
    rc, err = _run(capsys, "status", tmp_path / "no-such-run")
    assert rc == 2 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    assert _run(capsys, "status", tmp_path / "empty")[0] == 0                # an empty run folder is no error


def test_a_rollout_model_path_that_does_not_exist_fails_before_any_task(tmp_path, capsys):
    rc, err = _run(capsys, "rollout", "--run-dir", tmp_path / "run", "--set", f"model={tmp_path}/no/hf-stage-2")
    assert rc == 2
    _one_clear_line(err, "cannot start", "model", "no/hf-stage-2", "does not exist")
