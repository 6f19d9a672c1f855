#!/bin/bash
# Issue 64 item 4 (not yet measured): SortedRL on vLLM with a LLaMA-3.1-8B-shaped model (random weights from vLLM's
# dummy loader; the lengths imposed), the paper's §4.4.1 shape scaled to outputs of <= 2,048 tokens: 512 samples, 4
# batches, 128 slots, one engine for baseline, on-policy and partial (bench/bench_sortedrl_gpu.py). Out:
# $OUT/results.tgz with sortedrl_gpu.json (the table beside rollout_sim's prediction, the step time by running count)
# and the log. Expected ≈ 5-6 min on an H200 (vLLM start-up and CUDA graphs ≈ 1-2 min, then ≈ 8,200 decode steps of
# the baseline and ≈ 2,500 of each SortedRL run).
# vLLM: the device image has none (bench/gpu/lib.sh: torch, triton, transformers, pyarrow, xxhash, pyyaml), and a vLLM
# wheel with its CUDA kernels is far over the 64 MiB a call carries. Where `vllm` imports (the `gpu` extra of
# pyproject.toml) the runs are on vLLM; elsewhere on transformers' continuous batching on the card (--engine
# transformers, outputs <= 1,024 tokens), said so in the log and the JSON's "engine". The JSON is rewritten after each
# run, so a call cut off by its limit keeps the runs it finished.
# One call: run(command="LIMIT=560 bash bench/gpu/sortedrl_h200.sh", carry=[".whl-tf"], timeout_s=600), after
# `bash bench/gpu/prepare.sh` (it downloads .whl-tf).
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
# the lock's transformers (the device image has 5.17; grpo.engines.cb drives 5.23's continuous-batching internals),
# carried as .whl-tf by prepare.sh; its other requirements are the image's (hub 1.33, tokenizers 0.23, safetensors 0.8)
if ls .whl-tf/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-tf .whl-tf/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site-tf:$PWD PYTHONUNBUFFERED=1
R=/tmp/devres/r; rm -rf $R; mkdir -p $R; LOG=$OUT/log.txt
save() { cp $LOG $R/log.txt; tar -C /tmp/devres -czf $OUT/results.tgz r; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print(torch.__version__)"; git log -1 --format=%H 2>/dev/null; } >> $LOG 2>&1
ENGINE=vllm; ARGS=""
if ! python3 -c "import vllm; print('vllm', vllm.__version__)" >> $LOG 2>&1; then
  # the closest honest equivalent: transformers' continuous batching on the card (grpo.engines.cb), random bf16
  # weights, outputs scaled to <= 1,024 tokens so that its three runs fit one call (its steps cost more than vLLM's)
  echo "=== vllm is not importable here: the transformers engine on the card instead (--engine transformers)" >> $LOG
  ENGINE=transformers; ARGS="--max-len ${MAX_LEN:-1024}"
fi
echo "=== sortedrl on $ENGINE, LLaMA-3.1-8B shape (at $(( $(date +%s) - T0 ))s)" >> $LOG
timeout -k 10 $(( $(left) - 15 )) python3 -m bench.bench_sortedrl_gpu --out $R --model-dir /tmp/llama31-8b-shape \
  --engine $ENGINE $ARGS 2>&1 | grep -v "Warning\|warn(" >> $LOG
echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
grep -E "^===|^rc|^\||bubble" $LOG | tail -20
