"""Several ``pretrain.train`` command lines, one after another, in the same ranks (``test_parallel_parity.py``).

    torchrun --nproc-per-node N train_seq_child.py JOBS.json        (or plain python for one process)

``JOBS.json``: a list of ``{"copy": [SRC, DST]}`` (rank 0 copies a run folder, the others wait) and
``{"train": [ARGS...]}`` (``pretrain.train.main(ARGS)``, the trainer's own command line). Between two trainings
megatron's model-parallel groups are torn down, so the next one sets up its own TP/PP/CP layout on the same
process group; every other piece of a run's state — seeds, model, optimizer, loader, checkpoint — each training
builds afresh, as a new process would. Starting the ranks once for a layout's whole sequence saves each further
layout a launcher, an interpreter and megatron-core's import (about 6 CPU-s a rank)."""
import json
import os
import shutil
import sys
from pathlib import Path


def main(jobs_file: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import pretrain.train

    for job in json.loads(Path(jobs_file).read_text()):
        if "copy" in job:
            if int(os.environ.get("RANK", "0")) == 0:
                shutil.copytree(*job["copy"])
        else:
            rc = pretrain.train.main(job["train"])
            if rc:
                raise SystemExit(f"pretrain.train {' '.join(job['train'])}: exit {rc}")
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
