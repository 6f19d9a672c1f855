#!/bin/bash
# Issue 43 (fp8, torchtitan beside ovpipe, where bf16's time goes) and issue 41 item 4 (the 4B stage 1.5 on one
# 80 GB card with megatron-core's optimizer offload), in one device call, in order of priority, each run's JSON
# into $OUT/results.tgz as it ends (a cut call keeps what ran). Prepare on the CPU first: bash bench/gpu/prepare.sh
# Then one call: run(command="LIMIT=560 bash bench/gpu/next_call.sh", carry=[".whl", ".whl-titan", ".gpu"],
# kind="nvidia-h200", timeout_s=600). On the H200 the 4B's stage 1.5 fits without offload, so (a) and (b) run as
# the committed baseline did; (c) caps the allocator at an H100's 79.2 GiB (bench_mfu --memory-gib) to run the
# layout recompute auto picks for an 80 GB card. python -m bench.gpu.tables results/ --card h200 turns the
# unpacked results into the tables of bench/results/h200.md.
# ONLY="a b c tests rowwise eightb" picks among the parts; DRY=1 checks the plumbing on the CPU (tiny shapes,
# no figures): DRY=1 bash bench/gpu/next_call.sh
LIMIT=${LIMIT:-560}
ONLY=${ONLY:-a b c tests rowwise eightb}
want() { [[ " $ONLY " == *" $1 "* ]]; }
if [ -n "${DRY:-}" ]; then     # the CPU: no install, no card; the same functions at tiny shapes
  OUT=${OUT:-/tmp/next_call_dry}; rm -rf "$OUT"; mkdir -p "$OUT"
  T0=$(date +%s); left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
  R=/tmp/devres/r; rm -rf $R; mkdir -p $R; LOG=$OUT/log.txt
  save() { cp $LOG $R/log.txt; tar -C /tmp/devres -czf $OUT/results.tgz r; }
  PY=.venv/bin/python; TITAN_PATH=/tmp/site-titan:$PWD
  rm -rf /tmp/site-titan
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-titan .whl-titan/*.whl
else
  source bench/gpu/lib.sh
  PY=python3; TITAN_PATH=/tmp/site-titan:/tmp/site:$PWD
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-titan \
    .whl-titan/*.whl >> $LOG 2>&1 || echo "torchtitan's wheels did not install" >> $LOG
fi
CAP=79.2      # an H100's memory as torch reports it (pretrain.trainer.memory.CARDS)
# the 4B stage 1.5 runs of (a): one pack per step, the baseline's fastest setting that fits (none / selective /
# liger, bench/results/h200.md), the same packs and seed in each precision
A_ARGS="--recompute none --vision-recompute selective --loss-kernel liger"

run4b() {  # name timeout args... : one 4B bench_mfu run (lib.sh's mfu; on the CPU a tiny stand-in, no figure)
  if [ -z "${DRY:-}" ]; then mfu "$@"; return; fi
  local name=$1; shift 2
  echo "=== $name (dry: the tiny recipe, 2 steps, bench_mfu's flags checked): $*" >> $LOG
  $PY -m bench.bench_mfu --run-dir /nonexistent "$@" >> $LOG 2>&1        # parses, then skips without CUDA
  rm -rf /tmp/dry-$name; cp -r .gpu/run8k /tmp/dry-$name
  local p=bf16; [[ " $* " == *" fp8"* ]] && p=fp8
  $PY -m pretrain.train --run-dir /tmp/dry-$name --recipe tiny --stage 1.5 --steps 2 --micro-batch 1 --init scratch \
    --metrics-out /tmp/dry-$name/m.json >> $LOG 2>&1
  $PY - "$name" "$p" /tmp/dry-$name/m.json $R/$name.json <<'PY' >> $LOG 2>&1
import json, sys
name, p, src, dst = sys.argv[1:]
ms = json.load(open(src))["metrics"]
json.dump({"summary": {"dry_run": True, "precision": "fp8-tensorwise" if p == "fp8" else "bf16",
           "losses": [m["loss"] for m in ms],
           "tokens_per_s_median": ms[-1]["tokens_per_s"], "mfu_median": ms[-1]["mfu"], "peak_mem_gib": None,
           "host_peak_rss_gib": None, "optimizer_share": None, "command": "(dry run)"}}, open(dst, "w"))
PY
  echo "rc $? at $(( $(date +%s) - T0 ))s" >> $LOG; save
}

titan() {  # name timeout args... : one bench_titan run (torchtitan's wheels on the path)
  local name=$1 t=$2; shift 2
  if [ $(left) -lt $((t + 15)) ]; then echo "=== $name skipped: $(left)s left" >> $LOG; return; fi
  local data="--run-dir .gpu/run8k"     # a dry run's torchtitan side: random tokens (8K on the CPU's flex attention)
  [ -n "${DRY:-}" ] && [[ " $* " == *" titan "* ]] && data=
  echo "=== $name: bench_titan $* (at $(( $(date +%s) - T0 ))s)" >> $LOG
  PYTHONPATH=$TITAN_PATH timeout -k 10 $t $PY -m bench.bench_titan $data --out $R/$name.json \
    ${DRY:+--cpu --steps 2 --warmup 1} "$@" 2>&1 | grep -v "Warning\|warn(\|^\[rank0\]:   " | tail -25 >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
}

# (a) fp8 vs bf16, the 4B stage 1.5, >= 50 steps each on the same packs and seed (the loss curves), tokens/s and
# MFU (against the bf16 peak) and peak memory; bf16's run also profiles 2 steps (item 3: the top kernels, the
# optimizer's share)
if want a; then
  run4b a_bf16 170 $A_ARGS --steps 52 --warmup 2 --profile 2
  run4b a_fp8_tensorwise 170 $A_ARGS --steps 52 --warmup 4 --precision fp8-tensorwise
fi
# (b) torchtitan's Qwen3 at the 4B's LLM shape vs ovpipe's LLM, the same 8K-token packs, compile on, bf16 and
# float8 (rowwise: torchtitan 0.3's converter has no tensorwise recipe)
if want b; then
  # torchtitan 0.3.0 is the newest release; whether it imports on this torch is checked first (seconds), and a
  # failure is logged with its last line instead of spending a run on it
  TT=
  PYTHONPATH=$TITAN_PATH $PY -c "import torchtitan.models.qwen3, torchtitan.components.quantization.float8" \
    > /tmp/titan_import.txt 2>&1 || TT=$(tail -1 /tmp/titan_import.txt)
  [ -n "$TT" ] && echo "=== torchtitan does not import on this torch: $TT" >> $LOG
  [ -z "$TT" ] && titan b_titan_bf16 110 --side titan --precision bf16 --steps 12 --warmup 4
  titan b_ovpipe_bf16 100 --side ovpipe --precision bf16 --steps 12 --warmup 4
  [ -z "$TT" ] && titan b_titan_fp8_rowwise 120 --side titan --precision fp8-rowwise --steps 12 --warmup 4
  titan b_ovpipe_fp8_rowwise 110 --side ovpipe --precision fp8-rowwise --steps 12 --warmup 4
fi
# (c) optimizer offload: the 4B stage 1.5 at DP = 1 under an 80 GB card's memory, with the share and recompute
# recompute auto picks there (asked of pretrain.trainer.memory here), 3 timed steps: tokens/s, peak GPU memory,
# host memory; then the tiny recipe's 3 losses offloaded against not (the GPU test)
if want c; then
  PICK=$($PY - <<'PY' 2>/dev/null
from pretrain.recipes import RECIPES
from pretrain.trainer.config import TrainConfig
from pretrain.trainer.memory import CARDS, resolve_auto
c = TrainConfig(run_dir=".", stage="1.5", steps=1, recipe="llava-ov-1.5-4b", recompute="auto")._device_defaults(True)
r, _ = resolve_auto(c, RECIPES["llava-ov-1.5-4b"], "all", {"tp": 1, "pp": 1, "cp": 1, "dp": 1}, 8192, 8192 * 190.0,
                    CARDS["h100"], log=lambda *_: None)
print(f"--optimizer-offload {r.optimizer_offload} --recompute {r.recompute} --vision-recompute {r.vision_recompute} "
      f"--loss-kernel {r.loss_kernel}")
PY
)
  echo "=== recompute auto at $CAP GiB picks: $PICK" >> $LOG
  run4b c_offload_4b 170 $PICK --memory-gib $CAP --steps 4 --warmup 1
fi
if want tests && [ -z "${DRY:-}" ]; then
  gputests tests/pretrain/test_optimizer_offload.py tests/pretrain/test_float8.py
fi
want rowwise && run4b a_fp8_rowwise 140 $A_ARGS --steps 12 --warmup 4 --precision fp8-rowwise
# issue 43 item 4: the 8B's stage 1.5 on the one card with whatever recompute auto fits (offload included: its
# weights, gradients and Adam state alone exceed an H200), so its tokens/s per GPU is measured, not extrapolated
want eightb && run4b e_8b_auto 200 --recipe llava-ov-1.5-8b --recompute auto --steps 4 --warmup 1
# (d) the parallel layouts (several ranks on the one card, host-staged collectives) go here when they are ready
if [ -z "${DRY:-}" ]; then
  finish
else
  echo "=== done at $(( $(date +%s) - T0 ))s" >> $LOG; save; grep -E "^===|^rc|Error|error:" $LOG
fi
