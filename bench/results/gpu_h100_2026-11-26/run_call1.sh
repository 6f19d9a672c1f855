#!/bin/bash
# One H100 (80 GB) call (carry [".whl", ".gpu", ".base"] from `BASE_REF=b9595c8^ bash bench/gpu/prepare.sh`: the
# trainer as issue 23 first measured it, for the before figure; kind nvidia-h100-x1, timeout_s 600), in the order
# that matters if it is cut:
#  - issue 23's H100 figure: the 4B at stage 1 (the projector trained: no Adam state for the rest; stage 1.5 at
#    DP = 1 needs ~73 GiB of weights, gradients and Adam state before activations) with recompute auto (its pick
#    and estimate land in the JSON beside the measured peak), one step profiled;
#  - issue 27: embed-images' whole call through the step itself with the GPU defaults (draft decode,
#    fast_resize: torch's uint8 resize): ViT-L-14 at a task's size (102,400 rows), ViT-H-14 at half of it (the
#    session's 15 device minutes);
#  - issue 23's H100 before figure: the same stage 1 run on the base tree (recompute full, one step profiled);
#  - the tiny recipe's bf16 losses against fp32 since the optimizer's foreach fallbacks;
#  - ViT-L-14 through embed_rows with PIL's resize (the last H200 figures' path), stage 1 at four packs per step, stage 1.5 refused by auto before any work (naming the layouts that fit),
#    the tests marked gpu.
# What a cut leaves undone is skipped by name in the log; stage1_h100_b.sh is the second call for it.
LIMIT=${LIMIT:-540}; EMBEDN=0
source bench/gpu/lib.sh
mfu stage1_auto 100 --stage 1 --kernels fused --profile 1
embed() {  # model rows variants...
  local m=$1 n=$2; shift 2
  [ $(left) -gt 100 ] || { echo "=== embed $m skipped: $(left)s left" >> $LOG; return; }
  CA="--models $m --images $n --distinct 2048 --batch-size 256 --embed $* --skip assign"
  echo "=== curation embed $m, $n rows: $* (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $(( $(left) - 8 )) python3 -m bench.bench_curation --gpu $CA --command "python -m bench.bench_curation --gpu $CA" \
    --json $R/embed_${m}_$(( ++EMBEDN )).json 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
}
embed ViT-L-14-quickgelu 102400 step+draft+fast@256
embed ViT-H-14-quickgelu 51200 step+draft+fast@256
mfu base_stage1 120 --stage 1 --recompute full --profile 1
tiny
embed ViT-L-14-quickgelu 102400 processes+draft@256
mfu stage1_auto_ga4 90 --stage 1 --kernels fused --grad-accum 4 --steps 6
mfu stage15_refused 45 --stage 1.5
gputests
finish
