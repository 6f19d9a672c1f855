#!/bin/bash
# One H200 call (carry [".whl", ".gpu"] from bench/gpu/prepare.sh, timeout_s 600): the recompute settings
# that should fit without rerunning the LLM's MLPs, at grad-accum 1 and 4, then embed-images' whole call at a
# task's size (100K rows), then stage 1. Why this order (bench/results/gpu_h200.md, 2026-11-26): `selective`
# reruns the LLM's and the tower's MLPs (HFU/MFU 1.20). The LLM kept whole (`none`) with the tower fully
# recomputed and liger's loss reruns ~7% of the FLOPs; its peak was never measured: ~121 GiB by the deltas
# of the measured peaks, 133.5 GiB by pretrain.trainer.memory's fit (whose `none` is an extrapolation), so
# this run also checks that fit (each JSON holds peak_estimate_gib beside peak_mem_gib). The grad-accum-4
# run takes the trainer's default, recompute auto (selective there by the estimate). Each run has its own
# timeout; what no longer fits in LIMIT seconds is skipped, so the results tarball always comes back.
LIMIT=${LIMIT:-570}
source bench/gpu/lib.sh
mfu none_vfull_liger 110 --recompute none --vision-recompute full --kernels fused --loss-kernel liger
mfu auto_ga4 120 --kernels fused --grad-accum 4
mfu none_vfull_liger_ga4 120 --recompute none --vision-recompute full --kernels fused --loss-kernel liger --grad-accum 4
mfu none_vfull_megatron 100 --recompute none --vision-recompute full --kernels fused --loss-kernel megatron
if [ $(left) -gt 100 ]; then
  CA="--models ViT-L-14-quickgelu --images 102400 --distinct 2048 --batch-size 256 --embed processes+draft@256 --skip assign"
  echo "=== curation embed, 100K rows (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout $(( $(left) - 8 )) python3 -m bench.bench_curation --gpu $CA --command "python -m bench.bench_curation --gpu $CA" --json $R/bench_curation_gpu_embed100k.json 2>&1 | grep -v "Warning\|warn(" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
fi
mfu mlp_vfull 90 --recompute mlp --vision-recompute full --kernels fused
mfu stage1 80 --stage 1 --kernels fused
finish
