"""The knobs of one training stage, in one validated dataclass (``TrainConfig``).

A wrong value fails here, before any process group, model or data is touched, with a ``ValueError``
naming the field and the value (``micro_batch must be >= 1, got 0``). Settings whose default depends
on the device (bf16, recompute, loader workers, the distributed optimizer, the peak FLOP/s that MFU
divides by) stay None until ``resolve(cuda, world, gpu_memory_gib)`` fills them in — once, before
anything is built —, so the saved ``stage.json`` records what actually ran.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ovpipe.config import check_range, check_step_folder
from pretrain.trainer.flops import vision_recompute_of  # noqa: F401  (the config's rule; flops needs it too)

MODES = ("full", "selective", "mlp", "none")
RECOMPUTE = MODES + ("auto",)      # auto: the fastest mode that fits the card (pretrain.trainer.memory)
VISION_RECOMPUTE = ("full", "selective", "none")
# fp8-*: torchao's float8 training on the LLM's trained linear layers (pretrain.model.float8), bf16 elsewhere;
# fp8 is fp8-tensorwise (torchao's table: the faster recipe)
PRECISIONS = ("bf16", "fp32", "fp8-tensorwise", "fp8-rowwise")
GRAD_REDUCE_DTYPES = ("fp32", "bf16")   # DP's gradient reduce (pretrain.trainer.optimizer.ddp_config)
FLOAT8_CAPABILITY = (8, 9)     # float8 tensor cores: Ada (sm89) and Hopper (sm90) onwards


CPU_PEAK_TFLOPS = 0.2          # a nominal figure: MFU on a CPU only shows the trend
GPU_PEAK_TFLOPS = 989.0        # H100/H200 SXM dense bf16


def accumulation(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches per step and DP rank that make ``global_batch`` packs per optimizer step; a
    ``ValueError`` naming the numbers where the layout cannot split it evenly (the trainer's check and
    ``ovpipe pretrain``'s, before it writes a job script)."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    per_step = micro_batch * dp
    if global_batch % per_step:
        raise ValueError(f"global_batch={global_batch} is not a multiple of micro_batch × dp = "
                         f"{micro_batch} × {dp}: give a global_batch that is, or another micro_batch")
    return global_batch // per_step


@dataclass(frozen=True)
class TrainConfig:
    run_dir: Path
    stage: str                               # "1" | "1.5" | "2" (pretrain.recipes.STAGES)
    recipe: str = "tiny"                     # pretrain.recipes.RECIPES
    steps: int | None = None                 # exactly one of steps / epochs
    epochs: float | None = None              # passes over the pack step: steps = ceil(E · packs / GBS)
    data: str | None = None                  # pack step folder to read; None: the stage's
    micro_batch: int = 2                     # packs per micro-batch (one THD sequence)
    grad_accum: int = 1                      # micro-batches per step and DP rank
    global_batch: int | None = None          # packs per optimizer step over all DP ranks (megatron's
                                             # --global-batch-size): sets grad_accum = global_batch /
                                             # (micro_batch × dp), so the update stays the same at any DP size
    lr: float | None = None                  # peak lr; None: the stage's
    seed: int = 0
    tokenizer: str | None = None             # None: RUN/tokenizer
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool | None = None   # None: on (a CPU too: pretrain.trainer.cpu_compat)
    bf16: bool | None = None                 # None: the stage's on GPU, fp32 on CPU
    precision: str | None = None             # bf16 | fp32 | fp8-tensorwise | fp8-rowwise (fp8: tensorwise);
                                             # None: what bf16 says. fp8 needs a card of sm89 or newer, tp = 1
    grad_reduce_dtype: str | None = None     # fp32 | bf16: the dtype DP reduces gradients in (pretrain.trainer.
                                             # optimizer.ddp_config); None: fp32. bf16 needs bf16 parameters
    optimizer_offload: float | None = None   # share of the Adam state and update on the host (megatron-core's
                                             # HybridDeviceOptimizer; needs CUDA and the distributed optimizer);
                                             # None: 0, or with recompute auto the least of memory.OFFLOAD_STEPS that
                                             # lets the stage fit the card when nothing fits without it
    recompute: str | None = None             # full | selective | mlp | none | auto; None: the stage's (auto) on
                                             # GPU, none on CPU
    vision_recompute: str | None = None      # the tower's: full | selective | none; None: follows recompute
                                             # (with auto: chosen with it)
    loader_workers: int | None = None        # DataLoader worker processes; None: 4 on GPU, 0 on CPU
    kernels: str | None = None               # eager | fused (pretrain.model.fused); None: fused on GPU, eager on CPU
    loss_kernel: str | None = None           # megatron | liger | torch; None: megatron, or with recompute auto
                                             # the one that lets the least recompute fit (trainer.memory)
    peak_tflops: float | None = None         # per device, what MFU divides by; None: 989 on GPU, 0.2 on CPU
    save_every: int = 0                      # checkpoint every N steps (0: at the end and on a signal)
    save_every_minutes: float = 0.0
    keep: int = 2                            # checkpoints kept (the newest K; 0: all)
    stop_after: int | None = None            # checkpoint and stop after this many steps of this run (drills)
    init: str = "previous"                   # previous: start from start_from's checkpoint when there is one;
                                             # scratch: from random initialisation, whatever exists
    start_from: str | None = None            # step folder of the start checkpoint; None: pretrain/stage-<previous>
    recompute_auto: object = dataclasses.field(default=None, compare=False, repr=False)   # resolve's choice

    def __post_init__(self):
        from pretrain.recipes import RECIPES, STAGES

        object.__setattr__(self, "run_dir", Path(self.run_dir))
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {self.recipe!r}")
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {sorted(STAGES)}, got {self.stage!r}")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"give exactly one of steps and epochs (got steps={self.steps}, epochs={self.epochs}): "
                             "steps fixes the optimizer steps, epochs derives them from the pack count")
        for name in ("steps", "micro_batch", "grad_accum", "global_batch", "tp", "pp", "cp", "stop_after",
                     "save_every", "keep", "loader_workers", "seed"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        for name in ("micro_batch", "grad_accum", "tp", "pp", "cp", "stop_after", "global_batch"):
            check_range(self, name, lo=1)
        if self.global_batch is not None:
            if self.grad_accum != 1:
                raise ValueError(f"give grad_accum or global_batch, not both (got grad_accum={self.grad_accum}, "
                                 f"global_batch={self.global_batch}): global_batch sets grad_accum per DP size")
            if self.global_batch % self.micro_batch:
                raise ValueError(f"global_batch must be a multiple of micro_batch, got global_batch="
                                 f"{self.global_batch} and micro_batch={self.micro_batch}")
        for name in ("steps", "save_every", "keep", "loader_workers", "seed", "save_every_minutes"):
            check_range(self, name, lo=0)
        for name in ("epochs", "peak_tflops"):
            check_range(self, name, lo=0, lo_open=True)
        if self.optimizer_offload is not None and (isinstance(self.optimizer_offload, bool)
                                                   or not isinstance(self.optimizer_offload, (int, float))):
            raise ValueError(f"optimizer_offload must be a number in [0, 1], got {self.optimizer_offload!r}")
        check_range(self, "optimizer_offload", lo=0, hi=1)
        if self.precision == "fp8":
            object.__setattr__(self, "precision", "fp8-tensorwise")
        if self.precision is not None:
            if self.precision not in PRECISIONS:
                raise ValueError(f"precision must be one of {list(PRECISIONS) + ['fp8']}, got {self.precision!r}")
            if self.bf16 is not None and self.bf16 != (self.precision != "fp32"):
                raise ValueError(f"precision={self.precision!r} contradicts bf16={self.bf16}: give one of them")
            if self.precision.startswith("fp8") and self.tp != 1:
                raise ValueError(f"precision={self.precision!r} runs at tp = 1, got tp={self.tp}: megatron's "
                                 "tensor-parallel linears communicate inside their own autograd function, which "
                                 "the float8 matmul replaces (pretrain.model.float8)")
        if self.grad_reduce_dtype is not None and self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype must be one of {list(GRAD_REDUCE_DTYPES)}, "
                             f"got {self.grad_reduce_dtype!r}")
        if self.grad_reduce_dtype == "bf16" and (self.bf16 is False or self.precision == "fp32"):
            raise ValueError("grad_reduce_dtype='bf16' needs bf16 parameters (megatron reduces in the parameters' "
                             "dtype unless told fp32), and this stage trains in fp32: drop one of them")
        check_range(self, "lr", lo=0)
        if self.data is not None:
            check_step_folder("data", self.data)
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {self.recompute!r}")
        if self.vision_recompute is not None and self.vision_recompute not in VISION_RECOMPUTE:
            raise ValueError(f"vision_recompute must be one of {list(VISION_RECOMPUTE)}, got {self.vision_recompute!r}")
        from pretrain.model.fused import KERNELS, LOSS_KERNELS

        if self.kernels is not None and self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {list(KERNELS)}, got {self.kernels!r}")
        if self.loss_kernel is not None and self.loss_kernel not in LOSS_KERNELS:
            raise ValueError(f"loss_kernel must be one of {list(LOSS_KERNELS)}, got {self.loss_kernel!r}")
        if self.loss_kernel not in (None, "megatron") and self.tp != 1:
            raise ValueError(f"loss_kernel={self.loss_kernel!r} needs the whole vocabulary on a rank (tp = 1), got "
                             f"tp={self.tp}: use loss_kernel='megatron' (vocab-parallel cross-entropy)")
        if self.init not in ("previous", "scratch"):
            raise ValueError(f"init must be 'previous' or 'scratch', got {self.init!r}")
        for name in ("sequence_parallel",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def resolve(self, cuda: bool, world: int = 1, gpu_memory_gib: float | None = None, log=None,
                capability: tuple[int, int] | None = None) -> TrainConfig:
        """The config that runs, resolved once, before any process group, model or data is built: the
        device defaults (bf16, recompute, kernels, loader workers, the distributed optimizer, the peak FLOP/s),
        the stage's data and lr, the stage it starts from, ``global_batch`` folded into ``grad_accum`` for
        this world's DP size (a global batch the layout cannot split evenly fails here), and ``recompute:
        auto`` weighed against ``gpu_memory_gib`` (``pretrain.trainer.memory``; its table kept in
        ``recompute_auto``), and fp8 refused on a card without float8 (``capability``: the CUDA card's; None:
        asked of torch). The trainer passes the result whole; ``stage.json`` records it."""
        if cuda and capability is None and (self.precision or "").startswith("fp8"):
            import torch

            capability = torch.cuda.get_device_capability()
        check_float8(self.precision, capability if cuda else None)
        cfg = self._device_defaults(cuda)
        dp = world // (cfg.tp * cfg.pp * cfg.cp)
        if cfg.global_batch is not None:
            cfg = dataclasses.replace(cfg, grad_accum=accumulation(cfg.global_batch, cfg.micro_batch, dp),
                                      global_batch=None)
        if cfg.recompute == "auto" and gpu_memory_gib is not None:    # without a card's size it stays auto
            from pretrain.data import pack_shape
            from pretrain.recipes import RECIPES, STAGES
            from pretrain.trainer.memory import resolve_auto

            tokens, attn_sq = pack_shape(cfg.run_dir, cfg.data)
            sizes = {"tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp, "dp": dp}
            cfg, auto = resolve_auto(cfg, RECIPES[cfg.recipe], STAGES[cfg.stage].trainable, sizes,
                                     cfg.micro_batch * tokens, cfg.micro_batch * attn_sq, gpu_memory_gib,
                                     log=log or (lambda *_: None))
            cfg = dataclasses.replace(cfg, recompute_auto=auto)
        if cfg.optimizer_offload is None:
            cfg = dataclasses.replace(cfg, optimizer_offload=0.0)
        return cfg

    def _device_defaults(self, cuda: bool) -> TrainConfig:
        from pretrain.model.fused import resolve_loss_kernel
        from pretrain.recipes import STAGES, start_folder

        st = STAGES[self.stage]
        if self.optimizer_offload and not cuda:
            raise ValueError(f"optimizer_offload={self.optimizer_offload} needs CUDA: megatron-core's "
                             "HybridDeviceOptimizer moves gradients and parameters on CUDA streams")
        if self.optimizer_offload and self.distributed_optimizer is False:
            raise ValueError(f"optimizer_offload={self.optimizer_offload} needs distributed_optimizer: megatron-core "
                             "offloads through its precision-aware distributed optimizer")
        bf16 = self.bf16 if self.precision is None else self.precision != "fp32"
        bf16 = (cuda and st.bf16) if bf16 is None else bf16
        if self.grad_reduce_dtype == "bf16" and not bf16:
            raise ValueError("grad_reduce_dtype='bf16' needs bf16 parameters, and this stage trains in fp32 here "
                             "(the default on a CPU): give precision bf16 too, or drop grad_reduce_dtype")
        recompute = (st.recompute if cuda else "none") if self.recompute is None else self.recompute
        if recompute == "auto" and not cuda:
            recompute = "none"          # a CPU run keeps everything; auto weighs a GPU's memory
        follows = self.vision_recompute is None and recompute != "auto"
        return dataclasses.replace(
            self, data=self.data or st.data, lr=st.lr if self.lr is None else self.lr,
            distributed_optimizer=True if self.distributed_optimizer is None else self.distributed_optimizer,
            bf16=bf16, precision=self.precision or ("bf16" if bf16 else "fp32"),
            grad_reduce_dtype=self.grad_reduce_dtype or "fp32",
            recompute=recompute,
            vision_recompute=vision_recompute_of(recompute) if follows else self.vision_recompute,
            loader_workers=(4 if cuda else 0) if self.loader_workers is None else self.loader_workers,
            kernels=("fused" if cuda else "eager") if self.kernels is None else self.kernels,
            # unset under recompute auto: weighed with the recompute against the card (trainer.memory)
            loss_kernel=None if recompute == "auto" and self.loss_kernel is None else
            resolve_loss_kernel(self.loss_kernel),
            peak_tflops=self.peak_tflops or (GPU_PEAK_TFLOPS if cuda else CPU_PEAK_TFLOPS),
            start_from=None if self.init == "scratch" else
            self.start_from or start_folder(self.stage))


def check_float8(precision: str | None, capability: tuple[int, int] | None) -> None:
    """A ``ValueError`` in one line, before any work, where ``precision`` is fp8 and the device has no float8
    tensor cores (``capability``: the CUDA card's (major, minor); None on a CPU)."""
    if precision and precision.startswith("fp8") and (capability is None or tuple(capability) < FLOAT8_CAPABILITY):
        have = "a CPU" if capability is None else f"a card of sm{capability[0]}{capability[1]}"
        raise ValueError(f"precision={precision!r} needs a CUDA card of compute capability "
                         f"{FLOAT8_CAPABILITY[0]}.{FLOAT8_CAPABILITY[1]} or newer (float8 tensor cores: L4, L40, "
                         f"H100, H200), this run has {have}: use precision bf16")
