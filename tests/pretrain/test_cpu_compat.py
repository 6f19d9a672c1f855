"""The CPU accommodations for megatron-core are for CPU processes only: a process with a CUDA device refuses
them, and the GPU build path never imports them."""
import subprocess
import sys

import pytest


def test_apply_refuses_in_a_process_with_cuda(monkeypatch):
    import torch

    from pretrain.trainer import cpu_compat

    monkeypatch.setattr(cpu_compat, "_APPLIED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="the GPU path is never patched"):
        cpu_compat.apply()


def test_setup_distributed_patches_only_without_cuda():
    """A fresh process that sees a CUDA device (faked) sets up the process group without importing cpu_compat;
    the same on a CPU imports and applies it."""
    code = ("import sys, torch\n"
            "torch.cuda.is_available = lambda: {cuda}\n"
            "import torch.distributed as dist\n"
            "from pretrain.trainer import build\n"
            "dist.init_process_group = lambda *a, **k: None\n"
            "dist.is_initialized = lambda: True\n"
            "torch.cuda.set_device = lambda *_: None\n"
            "try:\n    build.setup_distributed(1)\nexcept Exception:\n    pass\n"
            "print('pretrain.trainer.cpu_compat' in sys.modules)\n")
    for cuda, want in ((True, "False"), (False, "True")):
        out = subprocess.run([sys.executable, "-c", code.format(cuda=cuda)], capture_output=True, text=True,
                             timeout=300)
        assert out.stdout.strip().splitlines()[-1] == want, out.stdout + out.stderr[-2000:]
