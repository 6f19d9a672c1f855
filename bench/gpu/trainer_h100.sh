#!/bin/bash
# What the H100 call of 2026-11-26 (bench/results/gpu_h100_2026-11-26/run_call1.sh) did not reach, for issue
# 23's record (carry [".whl", ".gpu", ".base"]; kind nvidia-h100-x1, timeout_s 600): the tiny recipe's bf16
# losses against fp32 since the optimizer's decay and β2 per stage, stage 1 at four packs per step.
# ONLY="base tiny ga4 refused tests" picks among all five; the default is the two not yet run.
LIMIT=${LIMIT:-300}
ONLY=${ONLY:-tiny ga4}
source bench/gpu/lib.sh
want() { [[ " $ONLY " == *" $1 "* ]]; }
want base && SRC=.base mfu stage1 120 --stage 1 --recompute full --profile 1
want tiny && tiny
want ga4 && mfu stage1_auto_ga4 90 --stage 1 --kernels fused --grad-accum 4 --steps 6
want refused && mfu stage15_refused 45 --stage 1.5
want tests && gputests
finish
