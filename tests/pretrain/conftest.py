import os
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
