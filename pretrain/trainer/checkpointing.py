"""The trainer's checkpoint part: where a stage starts, and what a save writes.

A stage resumes from its own newest readable checkpoint (model, optimizer and the loader's position),
or starts from the previous stage's (weights only), or from the initialisation
(``pretrain.checkpoint.resume_point``). Saves go through ``pretrain.dist_ckpt.save``: megatron-core
distributed checkpointing written atomically as ``iter_<step>/`` with a ``latest`` pointer, the newest
``keep`` kept, and the loader state ``{"step": PACK_STEP, "packs_consumed": P}`` in its ``step.json``.
"""
from __future__ import annotations

from pathlib import Path

from pretrain import checkpoint, dist_ckpt
from pretrain.recipes import PREVIOUS


class StageCheckpoints:
    """``RUN/pretrain/stage-<S>/dist_ckpt/`` of one stage reading pack step ``data``."""

    def __init__(self, run_dir: Path, stage: str, data: str, keep: int, log=None):
        self.root = Path(run_dir) / "pretrain" / f"stage-{stage}" / "dist_ckpt"
        self.previous = Path(run_dir) / "pretrain" / f"stage-{PREVIOUS[stage]}" / "dist_ckpt" \
            if stage in PREVIOUS else None
        self.stage, self.data, self.keep, self.log = stage, data, keep, log
        self.how, self.start, self.src = checkpoint.resume_point(self.root, self.previous, dist_ckpt.readable,
                                                                 log=log)

    @property
    def resuming(self) -> bool:
        """A mid-stage resume: optimizer state and data position come back too (step 0 of a stage
        holds imported weights and no optimizer state)."""
        return self.how == "resume" and bool(self.start)

    def load_model(self, model) -> None:
        if self.src is None:
            return
        dist_ckpt.load_model(self.src, model)
        if self.log is not None:
            what = f"resuming at step {self.start}" if self.how == "resume" else "starting"
            self.log(f"stage {self.stage}: {what} from {self.src}")

    def load_optimizer(self, model, opt) -> None:
        if self.resuming:
            dist_ckpt.load_optimizer(self.src, model, opt)

    def start_pack(self, gbs: int) -> int:
        """The first pack of the stream not consumed: the checkpoint's loader state (checkpoints
        without one: the steps done × the global batch), so a resumed run reads what the
        uninterrupted run would have read next."""
        state = dist_ckpt.data_state(self.src) if self.resuming else None
        if state is not None and state.get("step") not in (None, self.data):
            raise ValueError(f"the checkpoint {self.src} was reading pack step {state['step']!r}, "
                             f"this run reads {self.data!r}")
        return state["packs_consumed"] if state is not None else self.start * gbs

    def save(self, model, opt, step: int, packs_consumed: int) -> Path:
        return dist_ckpt.save(self.root, model, opt, step, self.keep,
                              {"step": self.data, "packs_consumed": packs_consumed})

    def newest_step(self) -> int | None:
        found = checkpoint.newest(self.root, log=None)
        return None if found is None else found[0]
