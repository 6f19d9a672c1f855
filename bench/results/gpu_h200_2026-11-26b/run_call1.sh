#!/bin/bash
# One H200 call (carry [".whl", ".gpu", ".base"] from `BASE_REF=<the commit before> bash bench/gpu/prepare.sh`,
# timeout_s 600). Issue 23, in the order that matters if the call is cut:
#  1. base_selective / selective: the GPU default (recompute selective/selective, fused kernels) before and after
#     megatron's optimizer fallbacks ran on torch's _foreach kernels (pretrain.fused.foreach_optimizer), same card;
#     the second one profiled;
#  2. none_vfull_liger: the LLM kept whole, the tower fully recomputed, liger's loss (~7% of the FLOPs rerun
#     against selective's ~20%); its peak was never measured (~121 GiB by the measured deltas, 133.5 by
#     pretrain.trainer.memory's fit, an extrapolation), so it also checks that fit;
#  3. auto_ga4 (and none_vfull_liger_ga4 if 2 fits): four packs per optimizer step, as any real global batch at DP = 1;
# then issue 27: embed-images' whole call at a task's size (100K rows, ViT-L-14). Each run has its own timeout;
# what no longer fits in LIMIT seconds is skipped, and the results tarball is rewritten after each run.
LIMIT=${LIMIT:-540}
source bench/gpu/lib.sh
mfu base_selective 75 --kernels fused
mfu selective 75 --kernels fused --profile 1
mfu none_vfull_liger 75 --recompute none --vision-recompute full --kernels fused --loss-kernel liger
mfu auto_ga4 80 --kernels fused --grad-accum 4 --steps 6
if [ $(left) -gt 125 ]; then
  CA="--models ViT-L-14-quickgelu --images 102400 --distinct 2048 --batch-size 256 --embed processes+draft@256 --skip assign"
  echo "=== curation embed, 100K rows (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $(( $(left) - 8 )) python3 -m bench.bench_curation --gpu $CA --command "python -m bench.bench_curation --gpu $CA" --json $R/bench_curation_gpu_embed100k.json 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
fi
grep -q '"mfu_median"' $R/none_vfull_liger.json 2>/dev/null && \
  mfu none_vfull_liger_ga4 80 --recompute none --vision-recompute full --kernels fused --loss-kernel liger --grad-accum 4 --steps 6
finish
