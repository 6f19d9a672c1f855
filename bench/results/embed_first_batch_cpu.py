"""Time to the first decoded batch of ``curation.decode.decoded_batches`` (worker processes), before and after
the workers prepare their first unit as they start, in one process, on the CPU, with 4 GB resident in the
parent (a fork copies its page tables). "before" is the previous ``curation/decode.py`` (``git show
b9bf263:curation/decode.py > /tmp/decode_before.py``). Run: .venv/bin/python bench/results/embed_first_batch_cpu.py"""
import importlib.util
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))
import open_clip  # noqa: E402
import torch  # noqa: E402

from bench.bench_curation_gpu import make_jpegs  # noqa: E402
from curation import decode as after  # noqa: E402

spec = importlib.util.spec_from_file_location("decode_before", "/tmp/decode_before.py")
before = importlib.util.module_from_spec(spec)
sys.modules["decode_before"] = before
spec.loader.exec_module(before)

rows, info = make_jpegs(Path("/tmp/probe-jpegs"), 64, 1024)
_, _, preprocess = open_clip.create_model_and_transforms("ViT-B-32", pretrained=None)
resident = torch.ones(int(4e9) // 4)          # 4 GB of anonymous memory, as a model's weights would be
for workers in (2, 4):
    for name, mod in (("before", before), ("after", after)):
        pre = mod.split_preprocess(preprocess)
        dec = mod.make_decoder(pre, "cpu", "cpu", 1.0, False)
        firsts, totals = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            it = mod.decoded_batches(partial(mod.list_batches, rows[:64 * workers * 2], 64), dec, "processes",
                                     workers, 2, unit=64)
            next(it)
            firsts.append(time.perf_counter() - t0)
            for _ in it:
                pass
            totals.append(time.perf_counter() - t0)
        print(f"{workers} workers, {name}: first batch {min(firsts):.3f} s, all {2 * workers} batches "
              f"{min(totals):.3f} s (best of 3)", flush=True)
