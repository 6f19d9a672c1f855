"""Nothing skipped quietly: a test that needs Chromium or Slurm fails naming it under CI=true and skips on a
developer's machine, where the run's last lines count the skips by reason (tests/conftest.py NEEDS); under
CI=true any other skip that is not a GPU test's fails the run. Each case is a pytest of its own in a
subprocess, Chromium and Slurm hidden by a PATH that holds only the venv's ``bin``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
NEEDY = [str(TESTS / "viewer" / "test_browser.py"),
         str(TESTS / "ovpipe" / "test_slurm_executor.py") + "::test_cluster_up_down_by_pid_leaves_no_daemon"]


def _pytest(args: list[str], ci: bool, cwd: Path = TESTS.parent) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith("PYTEST_XDIST")}
    env["PATH"] = str(Path(sys.executable).parent)        # no chromium, no sbatch / slurmctld
    if ci:
        env["CI"] = "true"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return r.returncode, (r.stdout + r.stderr).strip().splitlines()


def test_under_ci_a_test_needing_chromium_or_slurm_fails_naming_it():
    rc, lines = _pytest(NEEDY, ci=True)
    out = "\n".join(lines)
    assert rc == 1, out
    assert "test_browser.py::test_every_page_loads_in_chromium_without_console_errors" in out, out
    assert "CI=true, and this test needs Chromium (chromium on PATH" in out, out
    assert "CI=true, and this test needs Slurm (munged" in out, out
    assert "2 errors" in lines[-1], lines[-1]


def test_on_a_developer_machine_they_skip_and_the_last_lines_say_why():
    rc, lines = _pytest(NEEDY, ci=False)
    assert rc == 0, "\n".join(lines)
    tail = "\n".join(lines[-4:])
    assert "2 skipped" in lines[-1] and "skipped: 2" in tail, tail
    assert "1 × needs Chromium (chromium on PATH" in tail and "1 × needs Slurm (munged" in tail, tail


def test_under_ci_any_other_skip_fails_the_run_but_a_gpu_one_does_not(tmp_path, monkeypatch):
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.gpu\ndef test_gpu():\n    pass\n\n"
        "def test_lacks_a_tool():\n    pytest.skip('needs frobnicate')\n\n"
        "def test_fine():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a CUDA test\n")
    plugin = ["-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_skips.py")]
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")   # -p conftest
    rc_dev, dev = _pytest(plugin, ci=False, cwd=tmp_path)
    rc_ci, ci = _pytest(plugin, ci=True, cwd=tmp_path)
    assert rc_dev == 0 and "1 × needs frobnicate" in "\n".join(dev[-4:]), "\n".join(dev)
    tail = "\n".join(ci[-3:])
    assert rc_ci == 1 and "CI=true: the run fails" in tail and "test_lacks_a_tool" in tail, "\n".join(ci)


def test_under_ci_a_module_skipped_at_collection_or_a_skip_that_only_mentions_cuda_fails(tmp_path, monkeypatch):
    """A module-level ``importorskip`` is a collect report, not a test's; and the GPU exemption is the ``gpu``
    marker, so an unmarked skip whose text says CUDA (a pip error, say) is not exempt."""
    (tmp_path / "test_whole.py").write_text("import pytest\n\npytest.importorskip('no_such_module_7c1f')\n\n"
                                            "def test_never():\n    pass\n")
    (tmp_path / "test_text.py").write_text("import pytest\n\ndef test_pip():\n"
                                           "    pytest.skip('pip: no wheel of flash-attn for this CUDA')\n\n"
                                           "def test_fine():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a CUDA test\n")
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")   # -p conftest
    rc, out = _pytest(["-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path)], ci=True, cwd=tmp_path)
    tail = "\n".join(out[-4:])
    assert rc == 1 and "CI=true: the run fails — 2 test(s)" in tail, "\n".join(out)
    assert "test_whole.py" in tail and "test_pip" in tail, tail
