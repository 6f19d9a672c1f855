"""The installed transformers is checked before any work that loads the official LLaVA-OV-1.5 remote
code: an out-of-range version is one line naming the version and the range, exit code 2, and no task
started — never a ``ModuleNotFoundError`` in a task log. The version is faked, not installed."""
import re
import tomllib
from pathlib import Path

import pytest

from ovpipe.cli import main
from llava_ov import official

REPO = Path(__file__).resolve().parents[2]
TOO_NEW = "5.24.0"


@pytest.fixture
def too_new(monkeypatch):
    monkeypatch.setattr(official, "installed_transformers", lambda: TOO_NEW)
    monkeypatch.delitem(__import__("sys").modules, f"{official._PACKAGE}.modeling", raising=False)


def test_supported_range_is_pyprojects():
    """One range: every extra's transformers requirement in pyproject.toml is SUPPORTED_TRANSFORMERS."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ranges = {re.sub(r"\s", "", r[len("transformers"):]) for reqs in extras.values() for r in reqs
              if re.match(r"transformers\b", r)}
    assert ranges and all(set(r.split(",")) == set(official.SUPPORTED_TRANSFORMERS.split(",")) for r in ranges), ranges


def test_installed_version_is_in_range():
    """The lock's transformers is one the official modeling file supports (else make install is wrong)."""
    official.check_transformers()


def _one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert f"transformers {TOO_NEW} is installed" in err[0] and official.SUPPORTED_TRANSFORMERS in err[0], err[0]
    assert "Traceback" not in err[0] and "ModuleNotFoundError" not in err[0]
    return err[0]


@pytest.mark.parametrize("step, extra", [
    ("recaption", ["--set", "backend=transformers", "--set", "model=some/vlm"]),
    ("rollout", ["--set", "backend=transformers", "--set", "model=some/vlm"]),
])
def test_generation_steps_refuse_before_any_task(tmp_path, capsys, too_new, step, extra):
    run = tmp_path / "run"
    rc = main([step, "--run-dir", str(run), "--quiet", *extra])
    assert rc == 2
    assert "cannot start" in _one_error_line(capsys)
    assert not (run / step).exists()          # no step folder: no lock, no task, no log


def test_file_backend_needs_no_transformers(tmp_path, too_new):
    from inference.backends import check_backend_runtime

    check_backend_runtime(type("Cfg", (), {"backend": "file"})())


def test_export_and_import_refuse_before_any_work(tmp_path, capsys, too_new):
    assert main(["export-model", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys)
    assert not (tmp_path / "out").exists()
    assert main(["import-model", "--run-dir", str(tmp_path / "run"), "--llava-ov", str(tmp_path / "x")]) == 2
    _one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_official_load_refuses(too_new):
    with pytest.raises(official.IncompatibleTransformers, match=re.escape(official.SUPPORTED_TRANSFORMERS)):
        official.load()
