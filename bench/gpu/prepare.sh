#!/bin/bash
# What a device call carries (carry [".whl", ".gpu"], or [".whl", ".whl-cur"]), built on the CPU: the wheels the device image lacks
# (it has torch, triton, transformers, pyarrow, xxhash, pyyaml; no network) and an 8K-token run folder with
# the stage 1.5 packs (web captions) and the stage 1 packs (LLaVA-558K-style), ~44 MB. Both paths are
# local (.git/info/exclude). Usage: [BASE_REF=<commit>] bash bench/gpu/prepare.sh   (from the repository root, after
# make install)
set -euo pipefail
OV=.venv/bin/ovpipe
rm -rf .whl; mkdir -p .whl     # afresh: two builds of one wheel side by side make the device's install refuse both
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2 webdataset==1.0.2 braceexpand==0.1.7 \
  liger-kernel==0.8.5 open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4 einops==0.8.2 torchao==0.18.0
# torchtitan beside the trainer (bench/bench_titan.py; next_call.sh carries .whl-titan too): the newest release,
# and what importing its Qwen3 model and float8 converter needs beyond the device image (tyro, docstring_parser,
# spmd_types at the version it pins); its trainer's loaders (datasets, torchdata, wandb...) are not imported
rm -rf .whl-titan; mkdir -p .whl-titan
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .whl-titan torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 \
  spmd_types==0.2.3
# the lock's transformers alone, for sortedrl_h200.sh's continuous-batching engine (the device image has 5.17)
rm -rf .whl-tf; mkdir -p .whl-tf
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .whl-tf "transformers==$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')"
# duckdb (25 MB; the ingest step reads and writes manifests with it) apart: a curation call carries .whl and
# .whl-cur, a trainer call .whl, .gpu and .base (each under the 64 MiB a call carries)
rm -rf .whl-cur; mkdir -p .whl-cur
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .whl-cur duckdb==2.0.1
DATA=runs/demo-data-gpu; R=${RUN_GPU:-$PWD/.gpu/run8k}
rm -rf "$DATA" "$R"; mkdir -p "$(dirname "$R")"
$OV demo-data --out $DATA
$OV ingest --config configs/demo/ingest.yaml --set "inputs=[\"$DATA/shards/*.tar\"]" --run-dir $R --quiet
.venv/bin/python -m packing.tiny_tokenizer --out $R/tokenizer --run-dir $R   # on the captions only, as in every figure so far
$OV ingest --name ingest-llava --config configs/demo/ingest-llava.yaml --set "inputs=[\"$DATA/llava-558k/*.json\"]" \
  --run-dir $R --quiet
$OV lengths --config configs/demo/lengths.yaml --set tokenizer=$R/tokenizer --set seq_len=8192 --run-dir $R --quiet
$OV pack --config configs/demo/pack.yaml --set seq_len=8192 --run-dir $R --quiet
$OV lengths --name lengths-align --config configs/demo/lengths.yaml --set tokenizer=$R/tokenizer --set seq_len=8192 \
  --set 'samples_steps=[ingest-llava]' --run-dir $R --quiet
$OV pack --name pack-align --config configs/demo/pack.yaml --set lengths_step=lengths-align --set seq_len=8192 \
  --run-dir $R --quiet
rm -rf $R/lengths $R/lengths-align "$DATA"   # the packs hold the tokens and images; the trainer reads packs
# BASE_REF=<commit>: that commit's tree in .base (carry it too) for a before/after in one call (lib.sh's SRC=.base runs)
# A tree from before the trainer's varlen feature detection (b9595c8^, the code issue 23 measured first) calls
# varlen_attn(enable_gqa=...), which torch 2.11 lacks: its key/value are repeated to the query heads by hand
# there ("+ GQA patch" in bench/results/h200.md and h100.md).
if [ -n "${BASE_REF:-}" ]; then
  rm -rf .base; mkdir .base; git archive "$BASE_REF" | tar -x -C .base
  .venv/bin/python - <<'PY'
from pathlib import Path
p = Path(".base/pretrain/model/attention.py")
s = p.read_text()
old = "        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0), enable_gqa=gqa)"
new = ("        if gqa:\n"
       "            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))\n"
       "        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0))")
if old in s:
    p.write_text(s.replace(old, new))
    print("base: varlen_attn's enable_gqa replaced by key/value repeated to the query heads")
PY
fi
mkdir -p .git/info
grep -qx '/.whl-titan/' .git/info/exclude 2>/dev/null || echo '/.whl-titan/' >> .git/info/exclude
grep -qx '/.whl-tf/' .git/info/exclude || echo '/.whl-tf/' >> .git/info/exclude
grep -qx '/.base/' .git/info/exclude || echo '/.base/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
grep -qx '/.whl-cur/' .git/info/exclude || echo '/.whl-cur/' >> .git/info/exclude
du -sh .whl .whl-cur .whl-titan "$R"
