"""The import contract in pyproject.toml ([tool.importlinter]): manifests ← ovpipe (core) ← llava_ov (the published
format) ← curation, packing, pretrain, rl_select, inference, grpo ← demo, bench; pretrain's parts layered (the
steps ← train ← trainer ← data ← model); the run folder's modules layered (lock ← markers ← heartbeat,
cleanup ← upstream ← prepare, status); and no import circles inside a package. An upward
import (say, ovpipe/ importing packing, or a stage importing the demo) fails here."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "4 kept, 0 broken" in res.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    """The contract bites: the same layers over a copy where the core imports a stage."""
    import shutil

    for pkg in ("manifests", "ovpipe", "packing"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "ovpipe" / "registry.py", "a") as f:
        f.write("\n\ndef _upward():\n    from packing.binpack import pack\n    return pack\n")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_packages =\n    manifests\n    ovpipe\n    packing\n\n"
        "[importlinter:contract:layers]\nname = layers\ntype = layers\nlayers =\n    packing\n    ovpipe\n    manifests\n")
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-2000:]
    assert "ovpipe.registry -> packing.binpack" in res.stdout


def test_the_format_package_may_not_import_the_trainer(tmp_path):
    """The new layer bites too: llava_ov (below pretrain and inference) importing pretrain is refused by the
    project's own contract file, run over a copy."""
    import shutil

    for pkg in ("manifests", "ovpipe", "llava_ov", "curation", "packing", "pretrain", "rl_select", "inference",
                "grpo", "demo", "bench"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "llava_ov" / "convert.py", "a") as f:
        f.write("\n\ndef _upward():\n    from pretrain.recipes import RECIPES\n    return RECIPES\n")
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-2000:]
    assert "llava_ov.convert -> pretrain.recipes" in res.stdout
