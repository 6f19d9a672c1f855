"""The decode workers' per-image work on the CPU (libjpeg draft decode, open_clip's eval head to uint8, the unit's
torch.stack), one core: before = `ImageOps.exif_transpose(im).convert("RGB")` then `Compose(head + [PILToTensor()])`;
after = `curation.decode.decode_cpu` with the split head (`upright_rgb`, and `uint8_head`: RGB only where needed,
the crop as a view of the tensor; bit-identical to before, checked); fast = the same with `fast_resize`'s
`TensorHead` (torch's uint8 antialiased resize; checked within two levels). All with `jpeg_draft`, as on a GPU.
Interleaved in one run, over the GPU bench's JPEGs (0.68 MP on average).
Run: .venv/bin/python bench/results/decode_worker_cpu.py"""
import io, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parents[2]))
import open_clip.transform as ot
import torch
from PIL import Image, ImageOps
from torchvision import transforms as T
from bench.bench_curation_gpu import make_jpegs
from curation.decode import decode_cpu, split_preprocess, tensor_head

torch.set_num_threads(1)                  # as in a DataLoader worker

rows, info = make_jpegs(Path("/tmp/upright-jpegs"), 64, 256)
print(info)
preprocess = ot.image_transform(224, is_train=False)
head_before = T.Compose(preprocess.transforms[:-2] + [T.PILToTensor()])     # the transform less ToTensor, Normalize
head_after = split_preprocess(preprocess).to_uint8
head_fast = tensor_head(split_preprocess(preprocess))
print("before:", head_before, "\nafter:", head_after, "\nfast:", head_fast)


def before(row):
    from curation.ingest import read_image_bytes
    with Image.open(io.BytesIO(read_image_bytes(row))) as im:
        im.draft("RGB", (224, 224))
        return head_before(ImageOps.exif_transpose(im).convert("RGB"))


def after(row):
    return decode_cpu(row, head_after, 224)[0]


def fast(row):
    return decode_cpu(row, head_fast, 224)[0]


assert all(torch.equal(before(r), after(r)) for r in rows[:64])
assert all((before(r).int() - fast(r).int()).abs().max() <= 2 for r in rows[:64])
ms = {"before": [], "after": [], "fast": []}
for _ in range(8):
    for name, fn in (("before", before), ("after", after), ("fast", fast)):
        t = time.perf_counter()
        torch.stack([fn(r) for r in rows])
        ms[name].append((time.perf_counter() - t) / len(rows) * 1e3)
for name, v in ms.items():
    print(f"{name}: {min(v):.3f} ms/image best of 8, median {sorted(v)[4]:.3f}")
for name in ("after", "fast"):
    print(f"{name} / before: best {min(ms[name]) / min(ms['before']):.3f}, median "
          f"{sorted(ms[name])[4] / sorted(ms['before'])[4]:.3f}")
