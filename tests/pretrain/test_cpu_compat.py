"""The CPU accommodations for megatron-core are for CPU processes only: a process with a CUDA device refuses
them, and the GPU build path never imports them."""
import json
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


# One process set up by ``build.setup_distributed(1)``, a CUDA device faked or not; it prints which of
# cpu_compat's six replacements are in place afterwards, and the backend asked of init_process_group (which
# then sets up a real one-rank gloo group, so megatron's parallel state is built as on a real run).
SET_UP = """
import json, sys, torch
fake_cuda = {cuda}
if fake_cuda:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *_: None
    torch.cuda.current_device = lambda: 0       # the device UUID the set-up publishes for the collectives path
    torch.cuda.get_device_properties = lambda i: type("Props", (), {{"uuid": "GPU-fake-0"}})()
import torch.distributed as dist
asked, real_init = [], dist.init_process_group
dist.init_process_group = lambda backend, *a, **k: (asked.append(backend), real_init("gloo", *a, **k))[1]
before = dict(current_device=torch.cuda.current_device, synchronize=torch.cuda.synchronize,
              current_stream=torch.cuda.current_stream)
from pretrain.trainer import build
sizes = build.setup_distributed(1)
from megatron.core.optimizer import optimizer as mc_optimizer
from megatron.core.tensor_parallel import random as mc_random
patched = {{
    "current_device": torch.cuda.current_device is not before["current_device"],
    "rng_tracker": type(mc_random.get_cuda_rng_tracker()).__name__ == "CPURNGTracker",
    "synchronize": torch.cuda.synchronize is not before["synchronize"],
    "cuda_to_cpu_mode": torch._C._len_torch_function_stack() > 0,
    "current_stream": torch.cuda.current_stream is not before["current_stream"],
    "clip_grads": mc_optimizer.clip_grad_by_total_norm_fp32.__name__ == "_clip_grads_cpu",
}}
if not fake_cuda:       # what the patches are for: a literal device="cuda" lands on the CPU
    patched["factory_on_cpu"] = torch.zeros(1, device="cuda").device.type == "cpu"
print(json.dumps({{"sizes": sizes, "asked": asked, "patched": patched,
                  "imported": "pretrain.trainer.cpu_compat" in sys.modules}}))
"""


def test_setup_distributed_patches_only_without_cuda():
    """With a CUDA device (faked) the set-up asks for nccl and leaves every one of cpu_compat's replacements
    out, without importing it; on a CPU it asks for gloo and every replacement is in place. Both processes
    must finish the set-up: an exception fails the test."""
    procs = {cuda: subprocess.Popen([sys.executable, "-c", SET_UP.format(cuda=cuda)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for cuda in (True, False)}
    got = {}
    for cuda, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        got[cuda] = json.loads(out.strip().splitlines()[-1])
    one_rank = {"tp": 1, "pp": 1, "cp": 1, "dp": 1}
    gpu, cpu = got[True], got[False]
    assert gpu["sizes"] == one_rank and gpu["asked"] == ["nccl"] and not gpu["imported"], gpu
    assert not any(gpu["patched"].values()), f"patched in a process with CUDA: {gpu['patched']}"
    assert cpu["sizes"] == one_rank and cpu["asked"] == ["gloo"] and cpu["imported"], cpu
    assert all(cpu["patched"].values()), f"missing on the CPU: {[k for k, v in cpu['patched'].items() if not v]}"
