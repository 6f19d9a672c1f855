import os
import shutil
import socket

import pytest


@pytest.fixture(scope="session")
def megatron_single():
    """A one-process gloo group with megatron's model-parallel state (TP=1), CPU compat applied."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(2)
    if not torch.cuda.is_available():
        from pretrain.cpu_compat import apply

        apply()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    try:
        model_parallel_cuda_manual_seed(1234)
    except Exception:
        pass
    yield


@pytest.fixture(scope="session")
def packed_demo(ingested_run, tmp_path_factory):
    from ovpipe.cli import main
    from packing.tiny_tokenizer import main as build_tok

    run = tmp_path_factory.mktemp("pt")
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    assert build_tok(["--out", str(run / "tokenizer"), "--run-dir", str(run)]) == 0
    assert main(["lengths", "--set", f"tokenizer={run / 'tokenizer'}", "--set", "seq_len=512", "--run-dir", str(run),
                 "--quiet"]) == 0
    assert main(["pack", "--set", "seq_len=512", "--run-dir", str(run), "--quiet"]) == 0
    return run


