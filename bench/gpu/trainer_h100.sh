#!/bin/bash
# Trainer runs on one H100 that bench/results/h100.md does not have yet (carry [".whl", ".gpu", ".base"]; kind
# nvidia-h100-x1, timeout_s 600): the tiny recipe's bf16 losses against fp32 since the optimizer's decay and β2
# per stage, stage 1 at four packs per step.
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
