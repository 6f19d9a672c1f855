#!/bin/bash
# The pack cost model against time on one H200 (not yet measured): the 4B stage 1.5, bf16, every pack of
# .gpu/run8k's `pack` and `pack-align` steps (8K-token packs; prepare.sh builds them, with the `cost` column) one
# micro-batch each, forward + backward timed with CUDA events, 3 passes (bench/bench_pack_cost.py). Out: the
# Spearman correlation, the line time = a·cost + b with its R², and per-term weights fitted by NNLS — the
# cost_weights file `pack` takes (commit it as packing/cost_weights_h200_4b.json once measured).
# Prepare on the CPU first: bash bench/gpu/prepare.sh
# Then one call: run(command="LIMIT=420 bash bench/gpu/pack_cost_h200.sh", carry=[".whl", ".gpu"],
# kind="nvidia-h200", timeout_s=480).
LIMIT=${LIMIT:-420}
source bench/gpu/lib.sh
cost() {  # step timeout
  local step=$1 t=$2
  if [ $(left) -lt $((t + 15)) ]; then echo "=== pack_cost $step skipped: $(left)s left" >> $LOG; return; fi
  echo "=== pack_cost 4B stage 1.5, $step (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout -k 10 $t python3 -m bench.bench_pack_cost --run-dir .gpu/run8k --step $step --recipe llava-ov-1.5-4b \
    --stage 1.5 --device cuda --max-packs 96 --repeats 3 --warmup 4 --fit-out $R/pack_cost_4b_h200_$step.weights.json \
    --out $R/pack_cost_4b_h200_$step.json 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
}
cost pack 200
cost pack-align 150
finish
