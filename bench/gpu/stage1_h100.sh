#!/bin/bash
# The H100 (80 GB) figure: the 4B recipe at stage 1 (the projector trained: no Adam state for the rest; stage 1.5 at
# DP = 1 needs ~74 GiB of weights, gradients and Adam state before activations). kind nvidia-h100-x1.
T0=$(date +%s); LIMIT=${LIMIT:-300}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; LOG=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; nproc; git log -1 --format=%H 2>/dev/null; } >> $LOG 2>&1
save() { cp $LOG $R/log.txt; tar -C $OUT -czf $OUT/results.tgz r; }
mfu() {  # name timeout args...
  local name=$1 t=$2; shift 2
  if [ $(left) -lt $((t + 15)) ]; then echo "=== $name skipped: $(left)s left" >> $LOG; return; fi
  rm -rf /tmp/run-$name; cp -r .gpu/run8k /tmp/run-$name
  echo "=== $name: $* (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $t python3 -m bench.bench_mfu --run-dir /tmp/run-$name --recipe llava-ov-1.5-4b --steps 8 --warmup 2 --out $R/$name.json "$@" 2>&1 | grep -v "Warning\|warn(\|^\[rank0\]:   " >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; rm -rf /tmp/run-$name; save
}
mfu stage1 100 --stage 1 --kernels fused
mfu stage1_none 100 --stage 1 --kernels fused --recompute none
if false; then
  CA="--models ViT-L-14-quickgelu --images 102400 --distinct 2048 --batch-size 256 --embed processes+draft@256 --skip assign"
  echo "=== curation embed, 100K rows (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $(( $(left) - 8 )) python3 -m bench.bench_curation --gpu $CA --command "python -m bench.bench_curation --gpu $CA" --json $R/bench_curation_gpu_embed100k.json 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
fi
echo "=== done at $(( $(date +%s) - T0 ))s" >> $LOG; save
grep -E "^===|^rc|mfu_median|peak_mem|passed|failed|img_s|startup" $LOG | tail -40
