"""The compute rate the plan runs at: a ``bench/bench_mfu.py`` JSON (``--out``) measured on one card.

``ovpipe plan --calibration FILE`` takes the JSON a lab writes on one of its own nodes (any card of ``GPUS``,
any recipe); without one the plan takes ``DEFAULT``, the 4B stage 1.5 on one H200 at commit ``cdf4d0d``
(``bench/results/h200.md``: 41.0% MFU, 2.41 s a step of four 8K packs, ``recompute: auto``'s pick), and says
that this is one card's figure, neither a lower nor an upper bound for another card.

From the file's ``summary`` (medians over the timed steps):

- ``flops_per_s``: hardware FLOPs per second of the forward and backward, ``hfu_median × peak ×
  step_s_median / fwd_bwd_s_median`` (HFU counts the recomputed forward, so the rate holds at any recompute;
  the step's data wait and optimizer are taken out, the plan models the optimizer itself). ``peak``: the
  summary's ``peak_tflops``, else 989, what ``bench_mfu`` divides by unless told. On another card the rate
  scales with the bf16 peak (the same share of it).
- ``optimizer_s_per_param``: ``optimizer_s_median`` over the trained parameters of the measured rank's
  optimizer shard; on another card it scales with HBM bandwidth (Adam streams its state).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200" / "none_vsel_liger_ga4.json"
DEFAULT_COMMIT = "cdf4d0d"          # the tree that ran it (bench/results/h200.md); the JSON predates the field
REQUIRED = ("recipe", "stage", "device", "hfu_median", "mfu_median", "step_s_median", "fwd_bwd_s_median",
            "optimizer_s_median")


@dataclass(frozen=True)
class Calibration:
    card: str                  # the ``GPUS`` kind it ran on
    device: str                # as torch names it
    commit: str | None
    source: str
    recipe: str
    stage: str
    flops_per_s: float         # hardware FLOP/s of the forward+backward on ``card``
    mfu: float                 # model FLOPs over the whole step, as measured
    step_s: float
    optimizer_s_per_param: float
    measured_here: bool        # a file the user gave (False: ``DEFAULT``)

    def flops_per_s_on(self, gpu) -> float:
        from pretrain.plan.shapes import GPUS

        return self.flops_per_s * gpu.peak_tflops / GPUS[self.card].peak_tflops

    def optimizer_s_per_param_on(self, gpu) -> float:
        from pretrain.plan.shapes import GPUS

        return self.optimizer_s_per_param * GPUS[self.card].hbm_gbs / gpu.hbm_gbs

    def describe(self, gpu) -> str:
        """Where the compute figure comes from, as the plan prints it."""
        hfu = self.flops_per_s_on(gpu) / (gpu.peak_tflops * 1e12)
        where = f"{self.source}, {self.recipe} stage {self.stage}" + (f", commit {self.commit}" if self.commit else "")
        if self.card == gpu.name:
            return (f"compute at {hfu:.1%} of the {gpu.name}'s peak (forward+backward), measured on this card "
                    f"({where}; {self.mfu:.1%} MFU over the step)")
        return (f"compute at {hfu:.1%} of the {gpu.name}'s peak (forward+backward): the share measured on one "
                f"{self.card} ({where}; {self.mfu:.1%} MFU), not on an {gpu.name}. An {gpu.name} may keep a larger "
                f"or a smaller share of its own peak, so this is neither a lower nor an upper bound: measure one node "
                f"(docs/plan.md, 'Calibration') and pass --calibration")


def card_of(device: str) -> str:
    """The ``GPUS`` kind of a torch device name (``NVIDIA A800-SXM4-80GB`` → ``A800``)."""
    from pretrain.plan.shapes import GPUS

    for kind in GPUS:
        if kind in device.upper():
            return kind
    raise ValueError(f"calibration device {device!r} is none of the plan's cards ({', '.join(GPUS)}): add it to "
                     f"pretrain.plan.shapes.GPUS with its peak, NVLink, network, HBM, PCIe and host figures")


def load(path: str | Path, measured_here: bool = True) -> Calibration:
    """A ``bench_mfu`` JSON; a ``ValueError`` naming the file and the missing or bad field."""
    from pretrain.plan.shapes import rank_params
    from pretrain.recipes import RECIPES, STAGES
    from pretrain.trainer.config import GPU_PEAK_TFLOPS

    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--calibration {path}: not a readable JSON file ({e})") from None
    s = doc.get("summary") if isinstance(doc, dict) else None
    if not isinstance(s, dict):
        raise ValueError(f"--calibration {path}: no 'summary' object — give the file bench/bench_mfu.py --out wrote")
    for k in REQUIRED:
        if s.get(k) is None:
            raise ValueError(f"--calibration {path}: summary.{k} is missing (a bench_mfu run with timed steps "
                             f"writes it)")
    if s["recipe"] not in RECIPES or s["stage"] not in STAGES:
        raise ValueError(f"--calibration {path}: summary.recipe={s['recipe']!r} / stage={s['stage']!r} is not one "
                         f"of ovpipe's recipes and stages")
    for k in ("hfu_median", "step_s_median", "fwd_bwd_s_median"):
        if not isinstance(s[k], (int, float)) or s[k] <= 0:
            raise ValueError(f"--calibration {path}: summary.{k} must be a positive number, got {s[k]!r}")
    peak = float(s.get("peak_tflops") or GPU_PEAK_TFLOPS)
    recipe = RECIPES[s["recipe"]]
    tp, pp, dp, cp = (int(s.get(k) or 1) for k in ("tp", "pp", "dp", "cp"))
    trained = rank_params(recipe, STAGES[s["stage"]].trainable, tp, pp)["trained"]
    shard = trained / (dp * cp) if s.get("distributed_optimizer", True) else trained
    flops = s["hfu_median"] * peak * 1e12 * s["step_s_median"] / s["fwd_bwd_s_median"]
    return Calibration(card_of(s["device"]), s["device"], s.get("commit") or (DEFAULT_COMMIT if path == DEFAULT else
                       None), _shown(path), s["recipe"], s["stage"], flops, float(s["mfu_median"]),
                       float(s["step_s_median"]), float(s["optimizer_s_median"]) / shard, measured_here)


def _shown(path: Path) -> str:
    root = DEFAULT.parents[3]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


@functools.cache
def default_calibration() -> Calibration:
    return load(DEFAULT, measured_here=False)
