"""The plan's communication volume is the trainer's: ``pretrain.plan.comm_bytes`` against the bytes a real run
hands to ``torch.distributed``, counted by wrapping every collective in each rank (``comm_count_child.py``).

Two runs of one stage-1.5 step of the tiny recipe on CPU ranks, with the trainer's own DDP config (the
distributed optimizer, the parameter all-gather overlapped with the forward, fp32 gradients): 2 ranks at TP=2
with sequence parallelism, and 4 ranks at PP=2 × CP=2, whose DP×CP group of 2 carries the gradient
reduce-scatter and the parameter all-gather. Together they cover every kind the plan counts — TP, CP, PP and
DP's two — on every rank, each at that rank's own micro-batch length, and a DP×CP group of one, which
megatron hands its buffers to and which moves nothing. megatron pads each parameter's start
and each bucket of the DDP buffer, and the wire carries the padded buffer while the plan counts parameters,
so the DP kinds are compared at the buffer's size as the run reports it."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("comm_count_child.py")
RUNS = {"tp2-sp": (2, ["--tp", "2", "--sequence-parallel"]), "pp2-cp2": (4, ["--pp", "2", "--cp", "2"])}
KINDS = ("tp", "cp", "pp", "dp_grad", "dp_param")


@pytest.fixture(scope="module")
def counted(packed_demo, tmp_path_factory):
    """Each layout's ranks: their counted bytes per step, coordinates and DDP config (``comm_count_child``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    out = {}
    for name, (nproc, extra) in RUNS.items():
        run = tmp_path_factory.mktemp("comm") / name
        shutil.copytree(packed_demo, run, ignore=shutil.ignore_patterns("pretrain"))
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={nproc}", str(CHILD), str(run), str(run / "bytes.json"), *extra],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        out[name] = [json.loads((run / f"bytes.json.{i}").read_text()) for i in range(nproc)]
    return out


def _planned(rank: dict, step: dict) -> dict:
    from types import SimpleNamespace

    from pretrain.plan import comm_bytes
    from pretrain.recipes import RECIPES
    from pretrain.trainer.optimizer import ddp_config

    ddp = ddp_config(SimpleNamespace(distributed_optimizer=rank["ddp"]["use_distributed_optimizer"]), rank["dp"])
    assert ddp.grad_reduce_in_fp32 == rank["ddp"]["grad_reduce_in_fp32"]       # the run's own config
    assert ddp.overlap_param_gather == rank["ddp"]["overlap_param_gather"]
    (tokens,) = step["tokens"]
    return comm_bytes(RECIPES["tiny"], "1.5", rank["tp"], rank["pp"], rank["cp"], rank["dp"], 1, 1, tokens, ddp,
                      pp_rank=rank["pp_rank"], bf16=False, sequence_parallel=rank["sp"], recompute="none")


@pytest.mark.parametrize("layout", sorted(RUNS))
def test_the_plan_counts_what_each_rank_hands_to_its_collectives(counted, layout):
    for rank in counted[layout]:
        assert rank["ddp"]["use_distributed_optimizer"] and rank["ddp"]["overlap_param_gather"]
        (step,) = rank["steps"]
        got, plan = step["bytes"], _planned(rank, step)
        assert got["other"] == 0, step["calls"]          # every collective sorted into a kind
        for kind in ("tp", "cp", "pp"):
            assert got[kind] == plan[kind], (layout, rank["pp_rank"], kind, got, plan, step["calls"])
        # the wire carries the padded buffer; a DP×CP group of one carries nothing (megatron calls it anyway)
        padded = rank["buffer_elems"] / rank["trained_elems"] if rank["dp"] * rank["cp"] > 1 else 0
        for kind in ("dp_grad", "dp_param"):
            if padded:
                assert got[kind] == pytest.approx(plan[kind] * padded, rel=1e-12), (layout, kind, got, plan)
            else:
                assert got[kind] == plan[kind] == 0, (layout, kind, got, plan)
    assert {k for rank in counted[layout] for k in KINDS if rank["steps"][0]["bytes"][k]} == \
        ({"tp"} if layout == "tp2-sp" else {"cp", "pp", "dp_grad", "dp_param"})



def test_a_save_gathers_the_shards_the_step_left_to_the_next_forward(counted):
    """With the parameter all-gather overlapped, a step updates each rank's shard only; the replicas of a
    pipeline stage (its two CP ranks here) differ until the next forward, or until the save gathers them."""
    for pp_rank in (0, 1):
        replicas = [r for r in counted["pp2-cp2"] if r["pp_rank"] == pp_rank]
        assert len(replicas) == 2
        assert replicas[0]["params_before_save"] != replicas[1]["params_before_save"]
        assert replicas[0]["params_after_save"] == replicas[1]["params_after_save"]
