#!/bin/bash
# ovpipe GPU session 2026-11-26, one H200, one call: the trainer's kernels (4B bench_mfu variants, tiny
# bf16-vs-fp32 parity, GPU tests) and the curation bench. Every run has its own timeout and the script
# skips what no longer fits in LIMIT seconds, so the results tarball always comes back.
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
  timeout $t python3 -m bench.bench_mfu --run-dir /tmp/run-$name --recipe llava-ov-1.5-4b --steps 8 --warmup 2 --out $R/$name.json "$@" 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; rm -rf /tmp/run-$name; save
}
mfu fused_liger_selective 130 --recompute selective --kernels fused --loss-kernel liger
mfu fused_liger_none 130 --recompute none --kernels fused --loss-kernel liger --profile 1
mfu eager_megatron_selective 75 --recompute selective --kernels eager --loss-kernel megatron --steps 5 --profile 1
if [ $(left) -gt 150 ]; then
  echo "=== curation bench (at $(( $(date +%s) - T0 ))s)" >> $LOG
  CA="--models ViT-H-14-quickgelu ViT-L-14-quickgelu --images 10240 --distinct 2048 --batch-size 256 --decode-unit 32 --embed processes+draft nvjpeg:0.5+draft processes+draft@256 --layouts strided --tiles 32768x131072 32768x262144 --assign-inputs fp32 fp16"
  TC=$(( $(left) - 100 )); [ $TC -gt 170 ] && TC=170
  timeout $TC python3 -m bench.bench_curation --gpu $CA --command "python -m bench.bench_curation --gpu $CA" --json $R/bench_curation_gpu.json 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
fi
if [ $(left) -gt 75 ]; then
  echo "=== tiny fp32 / bf16, 3 steps (at $(( $(date +%s) - T0 ))s)" >> $LOG
  for p in fp32 bf16; do rm -rf /tmp/t$p; cp -r .gpu/run8k /tmp/t$p; done
  timeout 45 python3 -m pretrain.train --run-dir /tmp/tfp32 --recipe tiny --stage 1.5 --steps 3 --micro-batch 1 --lr 1e-3 --fp32 --metrics-out $R/tiny_fp32.json 2>&1 | tail -3 >> $LOG
  timeout 45 python3 -m pretrain.train --run-dir /tmp/tbf16 --recipe tiny --stage 1.5 --steps 3 --micro-batch 1 --lr 1e-3 --metrics-out $R/tiny_bf16.json 2>&1 | tail -3 >> $LOG
  save
fi
if [ $(left) -gt 50 ]; then
  echo "=== gpu tests (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/pretrain/test_fused.py tests/pretrain/test_packed_attention_gpu.py tests/curation/test_assign_gpu.py tests/curation/test_embed_decode.py 2>&1 | tail -15 >> $LOG
  save
fi
mfu eager_liger_none 80 --recompute none --kernels eager --loss-kernel liger
mfu fused_megatron_selective 90 --recompute selective --kernels fused --loss-kernel megatron
echo "=== done at $(( $(date +%s) - T0 ))s" >> $LOG; save
tail -c 6000 $LOG
