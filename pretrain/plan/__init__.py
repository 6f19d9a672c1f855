"""``ovpipe plan``: what a cluster gets for one stage, before a GPU-hour is spent.

    ovpipe plan --recipe llava-ov-1.5-8b --stage 1.5 --samples 85000000 --tokens-per-sample 1000 --gpus 128xA800
    ovpipe plan --recipe llava-ov-1.5-4b --stage 1 --steps 23000 --global-batch 5888 --slots samples \\
        --tokens-per-sample 1000 --gpus 184xA800
    ovpipe plan --recipe llava-ov-1.5-4b --stage 1.5 --run-dir RUN --data pack --gpus 64xH100 --calibration FILE

Every layout of the GPU count (TP and CP within a node, PP, DP the rest) that passes the trainer's own checks
(``pretrain.recipes.validate``, the global batch split over DP) is weighed, as the trainer runs it
(``pretrain.plan.model``): memory and the recompute that fits (``pretrain.trainer.memory.choose``, what
``recompute: auto`` runs; the least optimizer offload where nothing fits without), each stage's compute with the
tower whole on the first stage and on every TP and CP rank, the TP/CP/PP collectives one rank calls
(``comm_bytes``), the pipeline's 1F1B imbalance, DP traffic in the dtype and with the overlap of the trainer's
DDP config (``pretrain.trainer.optimizer.ddp_config``), and the optimizer step with offload's host Adam and PCIe
copies. The compute rate is a ``bench/bench_mfu.py`` JSON (``--calibration``; by default one H200's, named with
its commit, neither a lower nor an upper bound for another card: ``pretrain.plan.calibration``).

The data (``pretrain.plan.data``): a sample count with a length distribution, the steps and global batch of a
run, or a run's ``lengths`` or ``pack`` step. The plan prints the same samples as ovpipe's packs, unpacked as
the official trainer runs them (``--slots samples``: each global-batch slot one sample, the micro-batch padded
to its longest sample) and padded to ``seq_len``, side by side, with the share of each one's compute that is
padding. What it cannot know: the network a lab has beyond the card table, stragglers, data stalls,
checkpoints and restarts; ``docs/plan.md`` sets its predictions against every published run.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys

from pretrain.plan.model import (GPUS, IMAGE_SHARE, PACK_FILL, Call, Gpu, Plan, collectives, comm_bytes,  # noqa
                                 layouts, packed_stats, parse_gpus, plan, predict, rank_params, trainer_ddp)

FORM_NAMES = {"packed": "ovpipe's packs", "unpacked": "unpacked, as the official trainer runs it",
              "padded": "each sample padded to seq_len"}


def forms(a, n: int, gpu: Gpu, data, cal) -> dict:
    """Per form: (global batch in its slots, steps, plans fastest first, padding share)."""
    from pretrain.plan.data import FORMS
    from pretrain.recipes import RECIPES, STAGES

    recipe = RECIPES[a.recipe]
    per_pack = a.seq_len * PACK_FILL / data.mean                   # samples in one pack
    out = {}
    for form in FORMS:
        same_unit = (form == "packed") == (a.slots == "packs")
        if same_unit:
            gbs = a.gbs
        else:
            ratio = 1 / per_pack if form == "packed" else per_pack
            gbs = max(n * a.micro_batch, round(a.gbs * ratio / (n * a.micro_batch)) * n * a.micro_batch)
        steps = math.ceil(a.epochs * data.slots(form, a.seq_len) / gbs)
        stats, useful = data.micro(form, a.seq_len, a.micro_batch)
        sample_len = stats["attn_sq"] / max(stats["tokens"], 1.0)
        plans = plan(a.recipe, a.stage, (n, gpu), steps, gbs, a.seq_len, sample_len, a.micro_batch,
                     stats=stats, useful_tokens=useful, calibration=cal, recompute=a.recompute)
        out[form] = (gbs, steps, plans,
                     data.padding_share(recipe, STAGES[a.stage].trainable, form, a.seq_len, a.micro_batch))
    return out


def with_straggler(p, loss: float | None):
    """A plan whose every step waits for its slowest DP rank: ``loss`` (packing.compute_balance's straggler loss of the
    packs at this layout) more compute than the mean rank's; None (no costs, no whole step) leaves it as it is."""
    if not loss:
        return p
    extra = p.parts["compute"] * loss
    step = p.step_s + extra
    slow = p.step_s / step
    return dataclasses.replace(p, step_s=step, parts={**p.parts, "straggler": extra},
                               tokens_per_s_per_gpu=p.tokens_per_s_per_gpu * slow, mfu=p.mfu * slow,
                               hours=p.hours / slow, gpu_hours=p.gpu_hours / slow)


def run_stragglers(run_dir, step: str, plans: list, steps: int | None = None) -> tuple[list, bool]:
    """The packed plans with the measured straggler loss of a run's own packs at each layout: over the run's
    ``steps`` steps of the pack step's balanced stream (None: one epoch's), every epoch they reach
    (``run_straggler_loss``, as the data plan's ``pretrain.data.balance_of``); fastest first again; (plans,
    whether the packs carry costs)."""
    from functools import lru_cache

    from manifests.io import manifest_files
    from packing.compute_balance import pack_costs, run_straggler_loss
    from pretrain.data import balanced_group

    cost = pack_costs(manifest_files(run_dir, "packs", step))
    if cost is None:
        return plans, False
    group = balanced_group(run_dir, step)
    loss = lru_cache(lambda dp, mb, ga: run_straggler_loss(cost, group, dp, mb, ga, steps))   # layouts share a DP
    out = [with_straggler(p, loss(p.dp, p.micro_batch, p.grad_accum)) for p in plans]
    return sorted(out, key=lambda p: (p.hours, p.tp * p.pp * p.cp)), True


@contextlib.contextmanager
def _third_party_quiet():
    """Python warnings and torch's logging off while the plan models the trainer (``OVPIPE_VERBOSE=1`` shows them)."""
    import logging
    import warnings

    from ovpipe.console import verbose

    if verbose():
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)       # torch's own loggers (its pytree and cpp_extension notices)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def main(argv=None) -> int:
    from pretrain.plan import calibration as calib
    from pretrain.plan import data as data_mod
    from pretrain.recipes import RECIPES, STAGES

    ap = argparse.ArgumentParser(prog="ovpipe plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="llava-ov-1.5-8b", choices=sorted(RECIPES))
    ap.add_argument("--stage", default="1.5", choices=sorted(STAGES))
    ap.add_argument("--gpus", required=True, help=f"COUNTxKIND, KIND one of {', '.join(GPUS)} (e.g. 128xA800)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--samples", type=float, help="samples in the stage (with --tokens-per-sample)")
    src.add_argument("--steps", type=int, help="optimizer steps of the stage (with --global-batch, in --slots)")
    src.add_argument("--run-dir", help="a run whose lengths or pack step (--data) holds the stage's samples")
    ap.add_argument("--data", default="pack", help="with --run-dir: the lengths or pack step (default pack)")
    ap.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default 1)")
    ap.add_argument("--tokens-per-sample", type=float, default=1000.0,
                    help="mean tokens of a sample, text and image (default 1000)")
    ap.add_argument("--tokens-sigma", type=float, default=0.0,
                    help="spread of the sample lengths: σ of a log-normal (default 0: every sample the mean)")
    ap.add_argument("--slots", choices=["packs", "samples"], default="packs",
                    help="what one global-batch slot holds: ovpipe's packs (default), or one sample each, as the "
                         "official trainer runs unpacked data")
    ap.add_argument("--global-batch", type=int, help="slots per optimizer step (default: 8 per GPU)")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per pack, the unpacked trainer's cap")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--image-share", type=float, help=f"share of the tokens that are image tokens (default: the "
                                                      f"lengths step's, else {IMAGE_SHARE})")
    ap.add_argument("--recompute", choices=["full", "selective", "mlp", "none"],
                    help="the LLM's recompute as a run was configured (default: what recompute auto picks per layout)")
    ap.add_argument("--calibration", help="a bench/bench_mfu.py --out JSON measured on your own node")
    ap.add_argument("--network-gbs", type=float, help="GB/s per GPU and direction across nodes (default: the card's)")
    ap.add_argument("--nvlink-gbs", type=float, help="GB/s per GPU and direction within a node")
    ap.add_argument("--top", type=int, default=8, help="layouts printed, fastest first")
    a = ap.parse_args(argv)
    with _third_party_quiet():        # the model imports megatron and torch: their notices are not the plan's
        return _plan(ap, a, calib, data_mod)


def _plan(ap, a, calib, data_mod) -> int:
    try:
        n, gpu = parse_gpus(a.gpus)
        cal = calib.load(a.calibration) if a.calibration else calib.default_calibration()
    except ValueError as e:
        ap.error(str(e))
    if a.image_share is not None and not 0 <= a.image_share <= 1:
        ap.error(f"--image-share must be within [0, 1], got {a.image_share}")
    for name in ("network_gbs", "nvlink_gbs"):
        if getattr(a, name) is not None:
            if getattr(a, name) <= 0:
                ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
            gpu = dataclasses.replace(gpu, **{name: getattr(a, name)})
    a.gbs = a.global_batch or 8 * n
    share = IMAGE_SHARE if a.image_share is None else a.image_share
    try:
        if a.run_dir:
            data = data_mod.from_run(a.run_dir, a.data, a.image_share)
            if data.packs:
                from pretrain.data import pack_shape

                a.seq_len = pack_shape(a.run_dir, a.data)[0]
        elif a.steps is not None:
            per_slot = 1.0 if a.slots == "samples" else a.seq_len * PACK_FILL / a.tokens_per_sample
            data = data_mod.from_samples(a.steps * a.gbs * per_slot, a.tokens_per_sample, a.tokens_sigma, share)
        else:
            data = data_mod.from_samples(a.samples, a.tokens_per_sample, a.tokens_sigma, share)
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    result = forms(a, n, gpu, data, cal)
    costed = False
    if a.run_dir and data.packs:
        g, s_, ps, pad = result["packed"]
        ps, costed = run_stragglers(a.run_dir, a.data, ps, s_)
        result["packed"] = (g, s_, ps, pad)
    main_form = "packed" if a.slots == "packs" else "unpacked"
    gbs, steps, plans, _ = result[main_form]
    unit = "packs" if main_form == "packed" else "samples"
    print(f"{a.recipe} stage {a.stage} on {n} × {gpu.name} ({gpu.memory_gib:.0f} GiB, {gpu.peak_tflops:.0f} TFLOP/s "
          f"bf16, NVLink {gpu.nvlink_gbs:.0f} GB/s, network {gpu.network_gbs:.0f} GB/s a GPU): {data.source}, "
          f"{data.image_share:.0%} image tokens; {FORM_NAMES[main_form]}: {steps:,} steps × {gbs:,} {unit}"
          + (f" of {a.seq_len:,} tokens" if main_form == "packed" else f" (≤ {a.seq_len:,} tokens)"))
    print(cal.describe(gpu))
    if costed:
        print(f"each layout's step waits for its slowest DP rank: the straggler loss of {a.data}'s own packs at "
              f"that DP size, over the run's {result['packed'][1]:,} steps, is added to its compute "
              f"(packs.cost, packing.compute_balance)")
    if not plans:
        print("no layout fits: more GPUs, a shorter --seq-len, or a smaller --micro-batch")
        return 1
    # llm/vit recompute: the LLM's and the vision tower's activation recompute; loss: the cross-entropy kernel
    print(f"{'tp':>3} {'pp':>3} {'cp':>3} {'dp':>5} {'accum':>6} {'llm recomp':>10} {'vit recomp':>10} {'loss krn':>8} "
          f"{'GiB':>6} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'hours':>8} {'GPU-hours':>10}  beside compute")
    for p in plans[:a.top]:
        extra = ", ".join(f"{k} {v / p.step_s:.0%}" for k, v in p.parts.items()
                          if k != "compute" and v / p.step_s >= 0.005)
        if p.offload:
            extra += (", " if extra else "") + f"{p.offload:.0%} of the optimizer on the host ({p.host_gib:.0f} GiB)"
        print(f"{p.tp:>3} {p.pp:>3} {p.cp:>3} {p.dp:>5} {p.grad_accum:>6} {p.recompute:>10} {p.vision_recompute:>10} "
              f"{p.loss_kernel:>8} {p.peak_gib:>6.1f} {p.step_s:>8.2f} {p.tokens_per_s_per_gpu:>10,.0f} {p.mfu:>6.1%} "
              f"{p.hours:>8.1f} {p.gpu_hours:>10,.0f}  {extra or '-'}")
    print("the same samples three ways (best layout of each):")
    for form, (g, s, ps, pad) in result.items():
        if not ps:
            print(f"  {FORM_NAMES[form]:<44} no layout fits")
            continue
        b = ps[0]
        print(f"  {FORM_NAMES[form]:<44} {s:>9,} steps × {g:,} {'packs' if form == 'packed' else 'samples'}: "
              f"{b.hours:,.1f} h ({b.hours / 24:,.1f} days), {b.gpu_hours:,.0f} GPU-hours, padding {pad:.0%} of "
              f"the compute (tp={b.tp} pp={b.pp} cp={b.cp})")
    gbs, steps, packed, _ = result["packed"]          # what ovpipe runs: its packs
    if not packed:
        return 0
    best = packed[0]
    print(f"best: tp={best.tp} pp={best.pp} cp={best.cp} dp={best.dp}, {best.hours:.1f} h "
          f"({best.hours / 24:.1f} days), "
          f"{best.gpu_hours:,.0f} GPU-hours: ovpipe pretrain --recipe {a.recipe} --stage {a.stage} --tp {best.tp} "
          f"--pp {best.pp} --cp {best.cp}{' --sequence-parallel' if best.tp > 1 else ''}"
          f"{f' --optimizer-offload {best.offload}' if best.offload else ''}"
          f"{f' --recompute {a.recompute}' if a.recompute else ''} --micro-batch "
          f"{best.micro_batch} --global-batch {gbs} --steps {steps} --executor slurm --nodes "
          f"{math.ceil(n / gpu.per_node)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
