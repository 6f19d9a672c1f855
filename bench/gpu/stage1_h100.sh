#!/bin/bash
# One H100 (80 GB) call (carry [".whl", ".gpu"] from bench/gpu/prepare.sh, kind nvidia-h100-x1, timeout_s 600).
# Issue 23's H100 figure: the 4B at stage 1 (the projector trained: no Adam state for the rest; stage 1.5 at DP = 1
# needs ~73 GiB of weights, gradients and Adam state before activations), with recompute auto (its pick and
# estimate land in the JSON beside the measured peak) and at four packs per optimizer step; stage 1.5 must be
# refused by auto before any work, naming the layouts that fit. Then issue 27: embed-images' whole call at a task's
# size after the decode workers stopped copying (upright_rgb, uint8_head), ViT-L-14 then ViT-H-14, 102,400 rows.
LIMIT=${LIMIT:-540}
source bench/gpu/lib.sh
mfu stage1_auto 90 --stage 1 --kernels fused
mfu stage1_auto_ga4 90 --stage 1 --kernels fused --grad-accum 4 --steps 6
mfu stage15_refused 60 --stage 1.5
for M in ViT-L-14-quickgelu ViT-H-14-quickgelu; do
  [ $(left) -gt 140 ] || { echo "=== embed $M skipped: $(left)s left" >> $LOG; continue; }
  CA="--models $M --images 102400 --distinct 2048 --batch-size 256 --embed processes+draft@256 --skip assign"
  echo "=== curation embed $M, 100K rows (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $(( $(left) - 8 )) python3 -m bench.bench_curation --gpu $CA --command "python -m bench.bench_curation --gpu $CA" --json $R/embed100k_$M.json 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
done
finish
