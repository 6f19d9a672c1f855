"""The start-up of embed_rows's decode workers on the CPU (bench.bench_curation_gpu.startup_probe), with and
without 4 GB of resident anonymous memory in the parent: DataLoader forks every worker before any gets
work, and a fork copies the parent's page tables. Run: .venv/bin/python bench/results/embed_startup_probe_cpu.py"""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parents[2]))
import numpy as np, torch, open_clip
from bench.bench_curation_gpu import make_jpegs, startup_probe
rows, info = make_jpegs(Path("/tmp/probe-jpegs"), 64, 512)
print(info)
_, _, pre = open_clip.create_model_and_transforms("ViT-B-32", pretrained=None)
for w in (2, 8, 16):
    print(w, startup_probe(rows, pre, "cpu", w, 64))
big = torch.ones(int(4e9) // 4)   # 4 GB of anonymous memory, as a model's weights would be
print("with 4 GB resident:", startup_probe(rows, pre, "cpu", 16, 64))
