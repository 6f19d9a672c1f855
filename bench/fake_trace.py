"""The trainer's real step on fake tensors, one rank of an N-rank world in one process: its peak memory
(``torch.distributed._tools.mem_tracker.MemTracker``) and its FLOPs (``torch.utils.flop_counter``), set
beside ``pretrain.trainer.memory``'s estimate and ``pretrain.trainer.flops``'s count — the way torchtitan's
``scripts/estimate/estimation.py`` estimates memory, without a GPU.

What runs is the trainer's own code: ``build_model`` (RICE-ViT + projector + the Qwen3 ``GPTModel`` of
this rank's PP stage and TP shard, megatron-core's parallel layers), ``build_optimizer`` (megatron's DDP,
fp32 gradient buffer, ``overlap_grad_reduce``, the distributed optimizer), megatron's
``get_forward_backward_func`` (1F1B under PP) over ``grad_accum`` micro-batches the loader's ``BatchPrep``
shaped, and the optimizer step, twice (Adam's state is made in the first). Every tensor is a
``FakeTensor`` (shapes, dtypes, no storage: an 8B rank builds in well under 2 GiB of host memory), the
process group is PyTorch's ``fake`` backend (``FakeStore``: every collective returns at once), so one
process stands for rank ``rank`` of ``tp·pp·cp·dp`` ranks; ranks differ only in their role (PP stage), so
``roles`` lists one rank per stage.

Where it stops short of a GPU run, and why:

- **The device is the CPU, not CUDA.** Fake tensors may claim ``cuda`` for a forward, but autograd's
  backward on them needs a CUDA runtime: ``torch/csrc/autograd/engine.cpp``'s ``GraphTask::
  stash_current_streams`` asks ``at::cuda::detail::_hasPrimaryContext(0)``, which fails with
  "hasPrimaryContext expects a valid device index, but got device_index=0" on a machine without one. So
  the step runs the trainer's CPU code paths (``pretrain.trainer.cpu_compat``): eager kernels (no fused
  SwiGLU or RMSNorm), and the attention's CPU branches (one SDPA per sample above ``DENSE_MAX_TOKENS``,
  a dense block-diagonal mask below; under CP the all-gathered keys with a mask, as on a GPU). The
  distributed optimizer, a GPU feature in megatron (it checks ``param.type()`` for CUDA names), is kept
  as the CPU trainer keeps it (``cpu_compat``'s answer to that check).
- **No kernel, no speed, no NCCL.** Fake tensors run no kernel: nothing here is a time, a bandwidth, a
  kernel's workspace (cuBLAS, FlashAttention), the CUDA context or the caching allocator's
  fragmentation — the terms ``memory.CALIBRATION`` fits on measured peaks (its ``overhead`` and its
  factors above 1). The fake process group moves no bytes, so NCCL's buffers and any hang or mismatch
  between ranks' collectives are out of sight. The CPU's SDPA is not in ``FlopCounterMode``'s table,
  so core attention's FLOPs are not counted (matmuls, which are ~all of the rest, are).

So the comparison (``compare``) sets the traced peak beside the estimate with the calibration factors
(what ``recompute: auto`` weighs) and without them (factors 1, no overhead: the same tensors, counted),
and the traced matmul FLOPs beside ``flops.forward_flops``' non-attention terms.

Run: ``python -m bench.fake_trace --recipe llava-ov-1.5-4b --stage 1.5 --tp 1 --pp 1 --cp 2
--dp 4 --recompute none --vision-recompute selective`` (one JSON line per role; docs/fake_trace.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

IMAGE_PX = {"tiny": 56}          # a sample's image side (px) per recipe; others: 448 (1,024 patches)
TEXT_TOKENS = {"tiny": 8}        # a sample's text tokens per recipe; others: 64 (a short caption)


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    recipe: str = "tiny"
    stage: str = "1.5"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    rank: int = 0
    seq_len: int = 8192
    grad_accum: int = 1
    recompute: str = "none"
    vision_recompute: str = "none"
    loss_kernel: str = "megatron"
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    bf16: bool = True

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


def roles(spec: TraceSpec) -> list[int]:
    """One global rank per pipeline stage (megatron's order tp-cp-dp-pp: the stage is ``rank // (tp·cp·dp)``):
    the ranks of a stage differ only in which shard of the same shapes they hold."""
    per_stage = spec.tp * spec.cp * spec.dp
    return [s * per_stage for s in range(spec.pp)]


def synthetic_pack(recipe, seq_len: int, pad_id: int):
    """One ``seq_len``-token pack of caption-like samples, each ``TEXT_TOKENS`` text tokens around one
    ``IMAGE_PX``² image (448² px: 1,024 patches, 256 LLM tokens), and a loss-free text sample filling the
    rest: the tower sees ~3.1 patches per LLM token (the 4B's calibration pack: 27,479 / 8,192 = 3.35)."""
    from pretrain.data import PackedBatch

    px, text = IMAGE_PX.get(recipe.name, 448), TEXT_TOKENS.get(recipe.name, 64)
    img_tokens = (px // recipe.vit.patch_size) ** 2 // 4
    n = seq_len // (text + img_tokens)
    lens = [text + img_tokens] * n + ([seq_len - n * (text + img_tokens)] if seq_len > n * (text + img_tokens) else [])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, min(recipe.llm.vocab_size, 1000), (1, seq_len), generator=g)
    tokens[tokens == pad_id] = 10
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    for i in range(n):
        tokens[0, int(cu[i]) + 3:int(cu[i]) + 3 + img_tokens] = pad_id
    pos = torch.cat([torch.arange(n_) for n_ in lens])[None]
    mask = torch.ones(1, seq_len)
    mask[0, cu[1:].long() - 1] = 0
    if len(lens) > n:
        mask[0, int(cu[n]):] = 0
    images = [torch.randn(3, px, px, generator=g) for _ in range(n)]
    return PackedBatch(tokens, torch.roll(tokens, -1, 1), mask, pos, cu, max(lens), n, images, n_packs=1,
                       n_samples=len(lens), pack_ids=[0])


def _fake_batch(mode, b):
    """The prepared micro-batch as fake tensors; ``cu_seqlens`` as a fake *constant*, so the host reads of
    the sample boundaries (the CP split's ``cp_local_index``) see their values, as the loader's do."""
    conv = mode.fake_tensor_converter

    def fake(x, const=False):
        return None if x is None else conv.from_real_tensor(mode, x, make_constant=const)

    vi = b.vision
    from pretrain.model.vision import Spans, VisionInputs

    vision = VisionInputs(fake(vi.patches), fake(vi.gather), fake(vi.patch_index), fake(vi.cos), fake(vi.sin),
                          Spans(vi.spans, fake(vi.spans.cu, True)), fake(vi.token_index))
    return dataclasses.replace(b, tokens=fake(b.tokens), labels=fake(b.labels), loss_mask=fake(b.loss_mask),
                               position_ids=fake(b.position_ids), cu_seqlens=fake(b.cu_seqlens, True),
                               cp_index=fake(b.cp_index, True), vision=vision,
                               rotary=tuple(fake(x) for x in b.rotary))


@contextlib.contextmanager
def _dtype_casts_in_place():
    """``module.to(dtype)`` as ``param.data = param.to(dtype)`` (buffers replaced): ``nn.Module._apply``
    swaps a fake parameter with ``torch.utils.swap_tensors``, which refuses a tensor that FakeTensorMode
    holds a weak reference to. Same parameters, same attributes (megatron's ``tensor_model_parallel``…)."""
    orig = torch.nn.Module.to

    def to(self, *args, **kwargs):
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.dtype):
            return orig(self, *args, **kwargs)
        for m in self.modules():
            for p in m.parameters(recurse=False):
                if p.is_floating_point() and p.dtype != args[0]:
                    p.data = p.data.to(args[0])
            for k, b in m._buffers.items():
                if b is not None and b.is_floating_point():
                    m._buffers[k] = b.to(args[0])
        return self

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = orig


@contextlib.contextmanager
def _own_objects():
    """``all_gather_object`` answered with this rank's object for every rank: the fake group moves no bytes, so
    the pickled objects could not be read back (megatron gathers its parameter-group keys so; the ranks of one
    role hold the same keys)."""
    import torch.distributed as dist

    orig = dist.all_gather_object

    def gather(out, obj, group=None):
        out[:] = [obj] * len(out)

    dist.all_gather_object = gather
    try:
        yield
    finally:
        dist.all_gather_object = orig


def _held(ddp, opt) -> list:
    """What the step holds that MemTracker cannot find from the module: megatron's contiguous buffers (the
    bf16 parameters of the distributed optimizer, the fp32 gradient buffer the ``main_grad`` views point
    into) and the torch optimizers under megatron's (their fp32 master shards, their Adam state)."""
    held = []
    for buf in list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", [])):
        held += [t for t in (getattr(buf, "param_data", None), buf.grad_data) if t is not None]
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(o, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            held.append(inner)
            held += [p for g in inner.param_groups for p in g["params"]]
    return held


def _tracker():
    """A ``MemTracker`` that reads megatron's DDP wrapper through the module it wraps (the wrapper's
    ``buffers`` attribute, its list of gradient buffers, shadows ``nn.Module.buffers()``), and that lets the
    root module run once per micro-batch (MemTracker refuses a root's second forward, taking it for a new
    iteration; its per-module statistics are not read here, its global peak is)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            # the global peak only: MemTracker's per-module peaks walk every tracked module on every operator
            # (~1,000 modules in the 4B: minutes of CPU per step), and nothing here reads them
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def _pre_fw_hook(self, module, inputs):
            name = self._mod_tracker.get_known_fqn(module)
            if (module in self.memory_tracking and not self._mod_tracker.is_bw
                    and set(self._mod_tracker.parents) - {name} == {"Global"}):
                del self.memory_tracking[module]
            return super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            if not callable(module.buffers):
                module = module.module
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return Tracker()


@contextlib.contextmanager
def _host_reads(shape: list[int]):
    """What the step reads on the host, answered as a real run would:

    - small integer tensors (``cu_seqlens`` and its slices, up to ``2**16`` elements) stay fake *constants*
      that carry their values, so the CP split's sample boundaries (``pretrain.model.parallel``) read as the
      loader's do (torch keeps only one-element results constant);
    - under PP, megatron's p2p exchanges each micro-batch's activation shape before sending it (variable
      sequence lengths); the fake group moves no bytes, so the shape every micro-batch here has (the same
      pack: ``shape``) is the answer."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from torch._subclasses import fake_tensor

    limit, shapes = fake_tensor.CONSTANT_NUMEL_LIMIT, P2PCommunicator._communicate_shapes
    fake_tensor.CONSTANT_NUMEL_LIMIT = 1 << 16
    P2PCommunicator._communicate_shapes = lambda self, send_next, send_prev, recv_prev, recv_next: (
        list(shape) if recv_prev else [0, 0, 0], list(shape) if recv_next else [0, 0, 0])
    try:
        yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT, P2PCommunicator._communicate_shapes = limit, shapes


_COALESCED = ("allreduce_coalesced_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
              "reduce_scatter_tensor_coalesced_")
_LIB = []


def _coalesced_collectives_on_meta() -> None:
    """Meta kernels for c10d's coalesced collectives, as ``torch.distributed._meta_registrations`` gives the
    others (a ``FakeWork``): megatron's DDP gathers and reduces its buckets coalesced, and torch leaves
    these four out of its table (it calls them deprecated)."""
    if _LIB:
        return
    from torch.distributed._meta_registrations import create_fakework

    lib = torch.library.Library("c10d", "IMPL")
    for op in _COALESCED:
        lib.impl(op, lambda *args: create_fakework(args, return_first_arg=False), "Meta")
    _LIB.append(lib)


def _setup(spec: TraceSpec) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pretrain.trainer.cpu_compat import apply

    _coalesced_collectives_on_meta()
    apply()      # the RNG tracker, ``device="cuda"`` literals, streams: the CPU stand-ins the CPU trainer uses
    from megatron.core.optimizer import clip_grads, optimizer as mc_optimizer

    # but megatron's own clip, as on a GPU: its on-device coefficient never reads the norm on the host
    mc_optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=spec.rank, world_size=spec.world, store=FakeStore())
    if not ps.model_parallel_is_initialized():
        # a gloo group over the fake store cannot form: megatron's gloo groups off
        ps.initialize_model_parallel(tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp,
                                     context_parallel_size=spec.cp, create_gloo_process_groups=False)
        # the distributed optimizer asks for the DP groups' gloo twins (a checkpoint's host gathers only):
        # the same fake groups stand in
        ps._DATA_PARALLEL_GROUP_GLOO = ps.get_data_parallel_group()
        ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO = ps.get_data_parallel_group(with_context_parallel=True)
        ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO
        ps._EXPERT_DATA_PARALLEL_GROUP_GLOO = ps.get_expert_data_parallel_group()
        ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO = ps._EXPERT_DATA_PARALLEL_GROUP_GLOO
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}


def trace(spec: TraceSpec, steps: int = 2) -> dict:
    """The traced peak (bytes, by MemTracker's categories) and FLOPs (one step's forward + backward) of rank
    ``spec.rank``: ``steps`` optimizer steps of ``grad_accum`` synthetic packs each."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from pretrain.data import BatchPrep
    from pretrain.recipes import RECIPES, STAGES
    from pretrain.trainer.build import build_model
    from pretrain.trainer.config import TrainConfig
    from pretrain.trainer.optimizer import build_optimizer, ddp_config, on_cuda

    recipe, stage = RECIPES[spec.recipe], STAGES[spec.stage]
    sizes = _setup(spec)
    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    pad_id = recipe.llm.vocab_size - 1
    scratch = tempfile.TemporaryDirectory(prefix="fake_trace_")     # the config's run folder and tokenizer: removed
    tmp = Path(scratch.name)                                         # when the trace ends (or, on an error, at exit)
    (tmp / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"content": "<|image_pad|>", "id": pad_id}]}))
    cfg = TrainConfig(run_dir=tmp, stage=spec.stage, recipe=spec.recipe, steps=1, tp=spec.tp, pp=spec.pp,
                      cp=spec.cp, sequence_parallel=spec.sequence_parallel, bf16=spec.bf16,
                      distributed_optimizer=spec.distributed_optimizer, recompute=spec.recompute,
                      vision_recompute=spec.vision_recompute, kernels="eager", loss_kernel=spec.loss_kernel,
                      tokenizer=str(tmp), grad_accum=spec.grad_accum)
    cfg = dataclasses.replace(cfg, precision="bf16" if spec.bf16 else "fp32")
    prep = BatchPrep(recipe.vit, recipe.llm.kv_channels, recipe.llm.rope_theta, pad_id, dtype, spec.tp, spec.cp,
                     ps.get_context_parallel_rank(), spec.sequence_parallel)
    real = prep(synthetic_pack(recipe, spec.seq_len, pad_id))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    batch = _fake_batch(mode, real)         # outside the mode: ``Spans`` reads its lengths on the host
    local = real.tokens.shape[1] // spec.cp // (spec.tp if spec.sequence_parallel else 1)
    with mode, _dtype_casts_in_place(), _own_objects(), _host_reads([local, 1, recipe.llm.hidden_size]):
        model = build_model(cfg, sizes, dtype)
        model.set_trainable(stage.trainable)
        ddp, opt = build_optimizer(model, stage, stage.lr, spec.bf16, dtype, ddp_config(cfg, sizes["dp"]))
        on_cuda(opt)         # the GPU's norm and scaling on ``_foreach`` kernels: no host sync, as on a GPU
        schedule = get_forward_backward_func()

        def forward_step(data_iterator, m):
            b = next(data_iterator)
            per_tok = m(b)

            def loss_func(per_tok):
                s = (per_tok.float() * b.loss_mask).sum()
                return s, b.loss_mask.sum().to(torch.int), {"lm": s.detach()}

            return per_tok, loss_func

        def step():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            schedule(forward_step_func=forward_step, data_iterator=iter([batch] * spec.grad_accum), model=[ddp],
                     num_microbatches=spec.grad_accum, seq_length=batch.tokens.shape[1], micro_batch_size=1,
                     forward_only=False)

        tracker = _tracker()
        tracker.track_external(model, *_held(ddp, opt))
        flops = FlopCounterMode(display=False)
        with tracker:
            for i in range(steps):
                with flops if i == steps - 1 else contextlib.nullcontext():
                    step()
                opt.step()
        peak = tracker.get_tracker_snapshot("peak")
    scratch.cleanup()
    # the accelerator the fake step ran on where the tracker saw one (the host's buffers count apart), else the host
    dev = next((k for k in peak if str(k) != "cpu"), next(iter(peak)))
    by_kind = {str(k).split(".")[-1].lower(): v for k, v in peak[dev].items()}
    return {"spec": dataclasses.asdict(spec), "stage_index": ps.get_pipeline_model_parallel_rank(),
            "first_stage": ps.is_pipeline_first_stage(), "last_stage": ps.is_pipeline_last_stage(),
            "peak_bytes": by_kind, "flops": int(flops.get_total_flops()),
            "flops_by_op": {str(k): int(v) for k, v in flops.get_flop_counts().get("Global", {}).items()},
            "stats": real.stats, "tokens_local": int(batch.labels.shape[1])}


MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution", "aten._convolution")


def expected_flops(spec: TraceSpec, stats: dict, stage_index: int) -> float:
    """``flops.flops_by_part``'s hardware FLOPs of one step on this rank, attention left out (the CPU's SDPA is
    not counted): the tower, patch embedding and projector whole on the first stage (every TP and CP rank),
    the decoder layers split over TP, CP and the stages, the output layer over TP and CP on the last stage."""
    from pretrain.recipes import RECIPES, STAGES, pipeline_sizes
    from pretrain.trainer.flops import flops_by_part

    recipe = RECIPES[spec.recipe]
    parts = flops_by_part(recipe, STAGES[spec.stage].trainable, {**stats, "attn_sq": 0, "vit_sq": 0},
                          spec.recompute, spec.vision_recompute)
    share = pipeline_sizes(recipe.llm.num_layers, spec.pp)[stage_index] / recipe.llm.num_layers
    f = parts["llm_layers"][1] * share / (spec.tp * spec.cp)
    if stage_index == 0:
        f += parts["vision"][1]
    if stage_index == spec.pp - 1:
        f += parts["llm_output"][1] / (spec.tp * spec.cp)
    return f * spec.grad_accum


RAW = {"overhead_gib": 0.0, "llm": 1.0, "vit": 1.0, "loss": 1.0}     # memory.estimate's tensors, uncalibrated


def compare(result: dict) -> dict:
    """One traced rank beside ``memory.estimate`` (calibrated, and ``RAW``: the same tensor counts without
    the factors and overhead fitted to measured peaks) and its FLOPs beside ``expected_flops``, in GiB and
    FLOPs. ``states``: what the step holds between steps (weights, fp32 gradient buffer, master weights, Adam);
    ``activations``: the rest of the peak (kept activations, the loss, transient buffers)."""
    from pretrain.recipes import RECIPES, STAGES
    from pretrain.trainer import memory

    spec = TraceSpec(**result["spec"])
    recipe, trainable = RECIPES[spec.recipe], STAGES[spec.stage].trainable
    lay = memory.Layout(tp=spec.tp, pp=spec.pp, cp=spec.cp, dp=spec.dp, sequence_parallel=spec.sequence_parallel,
                        distributed_optimizer=spec.distributed_optimizer, grad_accum=spec.grad_accum, bf16=spec.bf16)
    args = (recipe, trainable, spec.recompute, spec.vision_recompute, spec.loss_kernel, spec.seq_len, lay)
    est = memory.estimate(*args, vit_tokens=result["stats"]["vit_tokens"])
    raw = memory.estimate(*args, vit_tokens=result["stats"]["vit_tokens"], calibration=RAW)
    pk = {k: v / memory.GIB for k, v in result["peak_bytes"].items()}
    states = sum(pk.get(k, 0.0) for k in ("param", "buffer", "opt", "oth"))
    stage_states = memory.stage_state_bytes(recipe, trainable, lay)[result["stage_index"]] / memory.GIB
    counted = sum(v for k, v in result["flops_by_op"].items() if k in MATMULS)
    want = expected_flops(spec, result["stats"], result["stage_index"])
    return {"traced_gib": pk["total"], "traced_states_gib": states, "traced_activations_gib": pk["total"] - states,
            "states_gib": stage_states, "raw_activations_gib": raw["total"] - raw["states"],
            "raw_gib": raw["total"], "estimate_gib": est["total"],
            "traced_matmul_flops": counted, "expected_flops": want, "flops_ratio": counted / want if want else None}


def _layout(spec: TraceSpec) -> str:
    return f"tp{spec.tp} pp{spec.pp} cp{spec.cp} dp{spec.dp}" + (" sp" if spec.sequence_parallel else "")


def row(result: dict) -> str:
    """A markdown table row (``HEADER``) of one traced rank."""
    spec, c = TraceSpec(**result["spec"]), compare(result)
    where = f"stage {result['stage_index']}" + (" (tower)" if result["first_stage"] else "")
    return (f"| {spec.recipe} | {_layout(spec)} | {spec.grad_accum} | {spec.recompute}/{spec.vision_recompute}/"
            f"{spec.loss_kernel} | {where} | {c['traced_gib']:.1f} | {c['traced_states_gib']:.1f} | "
            f"{c['states_gib']:.1f} | {c['traced_activations_gib']:.1f} | {c['raw_activations_gib']:.1f} | "
            f"{c['raw_gib']:.1f} | {c['estimate_gib']:.1f} | {c['traced_matmul_flops'] / 1e12:.1f} | "
            f"{c['expected_flops'] / 1e12:.1f} |")


HEADER = ("| recipe | layout | accum | recompute (LLM/tower/loss) | rank | traced GiB | traced states | model "
          "states | traced activations | model activations (raw) | model raw | model (calibrated) | traced "
          "TFLOP | model TFLOP |\n" + "|" + " --- |" * 14)


def main(argv=None) -> int:
    """Trace one rank (``--rank``), or one rank per pipeline stage in child processes (megatron's parallel
    state is per process), and print a table row each (``--json``: the raw results, one per line)."""
    import argparse
    import subprocess
    import sys

    from pretrain.recipes import RECIPES, STAGES

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--recipe", default="tiny", choices=sorted(RECIPES))
    ap.add_argument("--stage", default="1.5", choices=sorted(STAGES))
    for name in ("tp", "pp", "cp", "dp"):
        ap.add_argument(f"--{name}", type=int, default=1)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens of the micro-batch's one pack")
    ap.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step (default: pp, 1F1B full)")
    ap.add_argument("--recompute", default="none", choices=["none", "mlp", "selective", "full"])
    ap.add_argument("--vision-recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--loss-kernel", default="megatron", choices=["megatron", "torch"])
    ap.add_argument("--rank", type=int, default=None, help="one global rank (default: the first of each stage)")
    ap.add_argument("--json", type=Path, default=None, help="append each rank's raw result here")
    a = ap.parse_args(argv)
    spec = TraceSpec(recipe=a.recipe, stage=a.stage, tp=a.tp, pp=a.pp, cp=a.cp, dp=a.dp, seq_len=a.seq_len,
                     grad_accum=a.grad_accum or a.pp, recompute=a.recompute, vision_recompute=a.vision_recompute,
                     loss_kernel=a.loss_kernel, sequence_parallel=a.sequence_parallel, rank=a.rank or 0)
    if a.rank is not None:
        print(json.dumps(trace(spec)))
        return 0
    print(HEADER)
    for r in roles(spec):
        cmd = [sys.executable, "-m", "bench.fake_trace", *(argv if argv is not None else sys.argv[1:]),
               "--rank", str(r)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None
        if line is None:
            print(f"| {spec.recipe} | {_layout(spec)} | rank {r} stops: {out.stderr.strip().splitlines()[-1]} |")
            continue
        result = json.loads(line)
        if a.json:
            with a.json.open("a") as f:
                f.write(line + "\n")
        print(row(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
