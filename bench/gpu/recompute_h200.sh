#!/bin/bash
# One H200 call (carry [".whl", ".gpu"] from bench/gpu/prepare.sh, timeout_s 600): the recompute settings
# that should fit without rerunning the LLM's MLPs, at grad-accum 1 and 4, then embed-images' whole call at a
# task's size (100K rows), then stage 1. Why this order (bench/results/gpu_h200.md, 2026-11-26): `selective`
# reruns the LLM's and the tower's MLPs (HFU/MFU 1.20). From the measured peaks, the LLM kept whole
# (`none`) with the tower fully recomputed and liger's loss should need ~121 GiB (none/none with liger
# ~141 GiB, less the tower's ~20 GiB) and rerun ~7% of the FLOPs. Each run has its own timeout; what no
# longer fits in LIMIT seconds is skipped, so the results tarball always comes back.
T0=$(date +%s); LIMIT=${LIMIT:-570}
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
mfu none_vfull_liger 110 --recompute none --vision-recompute full --kernels fused --loss-kernel liger
mfu selective_ga4 120 --kernels fused --grad-accum 4
mfu none_vfull_liger_ga4 120 --recompute none --vision-recompute full --kernels fused --loss-kernel liger --grad-accum 4
mfu none_vfull_megatron 100 --recompute none --vision-recompute full --kernels fused --loss-kernel megatron
if [ $(left) -gt 100 ]; then
  CA="--models ViT-L-14-quickgelu --images 102400 --distinct 2048 --batch-size 256 --embed processes+draft@256 --skip assign"
  echo "=== curation embed, 100K rows (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $(( $(left) - 8 )) python3 -m bench.bench_curation --gpu $CA --command "python -m bench.bench_curation --gpu $CA" --json $R/bench_curation_gpu_embed100k.json 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
fi
mfu mlp_vfull 90 --recompute mlp --vision-recompute full --kernels fused
mfu stage1 80 --stage 1 --kernels fused
echo "=== done at $(( $(date +%s) - T0 ))s" >> $LOG; save
grep -E "^===|^rc|mfu_median|peak_mem|passed|failed|img_s|startup" $LOG | tail -40
