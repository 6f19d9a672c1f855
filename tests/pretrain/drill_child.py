"""The training process of the kill drill (tests/pretrain/test_kill_drill.py), forked from a
forkserver that imported torch and megatron-core once, so each of the drill's runs starts in
seconds rather than re-importing them. A run is the command a user types, ``ovpipe pretrain ARGS``
(lock, input check, running marker, then ``pretrain.train``, in-process as the CLI runs one
process), in its own process group (``killpg`` takes all of it), with megatron's checkpoint writer
slowed down and announced in ``saves.log`` so the drill can kill inside a save."""
from __future__ import annotations

import os
import sys
import time

# what the forkserver imports once (test_kill_drill.py): the installed modules a run needs
PRELOAD = ["torch", "megatron.core.dist_checkpointing", "megatron.core.optimizer", "ovpipe.cli", "pretrain.stage",
           "pretrain.train", "pretrain.trainer.loop", "pretrain.trainer.build", "pretrain.trainer.optimizer",
           "pretrain.model.vlm"]


def run(argv: list[str], log: str, saves_log: str, save_delay_s: float) -> None:
    os.setsid()                                   # its own process group: the drill kills all of it
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = sys.stdout
    from megatron.core import dist_checkpointing

    write = dist_checkpointing.save

    def slow_save(sd, path, *a, **k):             # a save the drill can land in: before, during, after the write
        with open(saves_log, "a") as f:
            f.write(f"start {os.path.basename(path)}\n")
        time.sleep(save_delay_s / 2)
        out = write(sd, path, *a, **k)
        time.sleep(save_delay_s / 2)
        return out

    dist_checkpointing.save = slow_save
    from ovpipe.cli import main

    # SystemExit, not os._exit: multiprocessing's exit handlers then stop the Manager process that
    # megatron's checkpoint writer spawned (get_write_results_queue), instead of orphaning it
    sys.exit(main(["pretrain", *argv]))
