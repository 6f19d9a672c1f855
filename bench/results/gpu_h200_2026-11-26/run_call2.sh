#!/bin/bash
# second call, same session: recompute modes with the fused kernels, the compiled-kernel GPU tests, embed at 20K rows
T0=$(date +%s); LIMIT=${LIMIT:-315}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; LOG=$OUT/log2.txt
save() { cp $LOG $R/log2.txt; tar -C $OUT -czf $OUT/results2.tgz r; }
mfu() {
  local name=$1 t=$2; shift 2
  if [ $(left) -lt $((t + 10)) ]; then echo "=== $name skipped: $(left)s left" >> $LOG; return; fi
  rm -rf /tmp/run-$name; cp -r .gpu/run8k /tmp/run-$name
  echo "=== $name: $* (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $t python3 -m bench.bench_mfu --run-dir /tmp/run-$name --recipe llava-ov-1.5-4b --steps 8 --warmup 2 --out $R/$name.json "$@" 2>&1 | grep -v "Warning\|warn(\|^\[rank0\]:   " >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; rm -rf /tmp/run-$name; save
}
mfu fused_megatron_mlp 60 --recompute mlp --kernels fused --loss-kernel megatron --profile 1
mfu fused_megatron_mlp_vnone 55 --recompute mlp --vision-recompute none --kernels fused --loss-kernel megatron
mfu fused_liger_mlp_vnone 55 --recompute mlp --vision-recompute none --kernels fused --loss-kernel liger
echo "=== gpu tests (at $(( $(date +%s) - T0 ))s)" >> $LOG
timeout 50 python3 -m pytest -q -p no:cacheprovider -m gpu tests/pretrain/test_fused.py 2>&1 | tail -6 >> $LOG; save
if [ $(left) -gt 60 ]; then
  CA="--models ViT-H-14-quickgelu ViT-L-14-quickgelu --images 20480 --distinct 2048 --batch-size 256 --embed processes+draft@256 processes+draft@128 --skip assign"
  echo "=== curation embed (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $(( $(left) - 8 )) python3 -m bench.bench_curation --gpu $CA --command "python -m bench.bench_curation --gpu $CA" --json $R/bench_curation_gpu_embed20k.json 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG
fi
echo "=== done at $(( $(date +%s) - T0 ))s" >> $LOG; save
grep -E "^===|^rc|mfu_median|peak_mem|passed|failed|img_s" $LOG | tail -40
