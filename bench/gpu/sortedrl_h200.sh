#!/bin/bash
# Issue 64 item 4 (not yet measured): SortedRL on vLLM with a LLaMA-3.1-8B-shaped model (random weights from vLLM's
# dummy loader; the lengths imposed), the paper's §4.4.1 shape scaled to outputs of <= 2,048 tokens: 512 samples, 4
# batches, 128 slots, one engine for baseline, on-policy and partial (bench/bench_sortedrl_gpu.py). Out:
# $OUT/results.tgz with sortedrl_gpu.json (the table beside rollout_sim's prediction, the step time by running count)
# and the log. Expected ≈ 5-6 min on an H200 (vLLM start-up and CUDA graphs ≈ 1-2 min, then ≈ 8,200 decode steps of
# the baseline and ≈ 2,500 of each SortedRL run).
# vLLM: the device image has none (bench/gpu/lib.sh: torch, triton, transformers, pyarrow, xxhash, pyyaml), and a vLLM
# wheel with its CUDA kernels is far over the 64 MiB a call carries, so this runs on a machine where `vllm` imports
# (the `gpu` extra of pyproject.toml); elsewhere it stops at the check below, naming what is missing.
# One call: run(command="LIMIT=560 bash bench/gpu/sortedrl_h200.sh", kind="nvidia-h200", timeout_s=600).
# DRY=1 bash bench/gpu/sortedrl_h200.sh: the CPU dry run (no vLLM; the 8B config, the plan, the toy runs on CB).
# Then: copy the JSON's table into bench/results/bench_sortedrl_gpu.md in place of "to be measured".
set -uo pipefail
LIMIT=${LIMIT:-560}
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
if [ -n "${DRY:-}" ]; then
  OUT=${OUT:-/tmp/sortedrl_gpu_dry}; rm -rf "$OUT"; mkdir -p "$OUT"
  .venv/bin/python -m bench.bench_sortedrl_gpu --dry-run --model-dir "$OUT/llama31-8b-shape" --out "$OUT" 2>&1 \
    | grep -v "Warning\|warn(\|pytree"
  exit ${PIPESTATUS[0]}
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/devres/r; rm -rf $R; mkdir -p $R; LOG=$OUT/log.txt
save() { cp $LOG $R/log.txt; tar -C /tmp/devres -czf $OUT/results.tgz r; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print(torch.__version__)"; git log -1 --format=%H 2>/dev/null; } >> $LOG 2>&1
if ! python3 -c "import vllm; print('vllm', vllm.__version__)" >> $LOG 2>&1; then
  echo "=== vllm is not importable on this machine: install the gpu extra (pip install -e '.[gpu]') first" >> $LOG
  save; tail -5 $LOG; exit 3
fi
echo "=== sortedrl on vLLM, LLaMA-3.1-8B shape (at $(( $(date +%s) - T0 ))s)" >> $LOG
timeout -k 10 $(( $(left) - 15 )) python3 -m bench.bench_sortedrl_gpu --out $R --model-dir /tmp/llama31-8b-shape \
  2>&1 | grep -v "Warning\|warn(" >> $LOG
echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
grep -E "^===|^rc|^\||bubble" $LOG | tail -20
