import shutil

import pytest


@pytest.fixture(scope="session")
def megatron_single():
    """One process with megatron's model-parallel state (TP=PP=CP=1), set up the way training does it
    (``setup_distributed``: CPU compat applied, a private loopback gloo store)."""
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.train import setup_distributed

    torch.set_num_threads(2)
    setup_distributed(1)
    model_parallel_cuda_manual_seed(1234)
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


