"""Where a decode worker's time goes for a 224-pixel model (ViT-L-14, ViT-H-14), one core, over the GPU bench's
JPEGs (0.3-1 MP, 0.68 MP on average): libjpeg's decode whole and with the draft (the largest 1/2, 1/4, 1/8
reduction keeping both sides >= 224), the eval head on the drafted image (fast_resize's TensorHead against PIL's
resize), and the whole RowDecoder a GPU gets (draft + fast) against the same with PIL's resize. Best of 3.
Run: .venv/bin/python bench/results/decode_parts_cpu.py"""
import io, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parents[2]))
import torch
from open_clip.transform import image_transform
from PIL import Image
from bench.bench_curation_gpu import make_jpegs
from curation.decode import make_decoder, split_preprocess

torch.set_num_threads(1)                  # as in a DataLoader worker
rows, info = make_jpegs(Path("/tmp/decode-parts-jpegs"), 64, 128)
print(info)
pre = split_preprocess(image_transform(224, is_train=False))
fast = make_decoder(pre, "cuda", "cpu")                       # a GPU's defaults: draft + fast_resize
pil = make_decoder(pre, "cuda", "cpu", fast_resize=False)
datas = [open(r["images"][0]["file"], "rb").read() for r in rows]


def ms(fn, n=3):
    best = 1e9
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3 / len(datas)


def decode(draft):
    def f():
        for d in datas:
            im = Image.open(io.BytesIO(d))
            if draft:
                im.draft("RGB", (draft, draft))
            im.load()
    return f


ims = []
for d in datas:
    im = Image.open(io.BytesIO(d))
    im.draft("RGB", (224, 224))
    im.load()
    ims.append(im)
print("drafted sizes:", sorted(set(im.size for im in ims)))
print(f"decode, whole {ms(decode(None)):.2f} ms/image; with the draft {ms(decode(224)):.2f}")
print(f"head on the drafted image: fast_resize {ms(lambda: [fast.to_uint8(im) for im in ims]):.2f}; "
      f"PIL's resize {ms(lambda: [pil.to_uint8(im) for im in ims]):.2f}")
print(f"the whole RowDecoder (file read, draft decode, upright RGB, head): fast_resize "
      f"{ms(lambda: [fast(r) for r in rows]):.2f}; PIL's resize {ms(lambda: [pil(r) for r in rows]):.2f}")
