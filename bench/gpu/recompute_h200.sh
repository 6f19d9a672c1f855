#!/bin/bash
# One H200 call (carry [".whl", ".gpu"] from bench/gpu/prepare.sh, timeout_s 600): the recompute settings
# that should fit without rerunning the LLM's MLPs, at grad-accum 1 and 4, then embed-images' whole call at a
# task's size (100K rows), then stage 1. Why this order (bench/results/gpu_h200.md, 2026-11-26): `selective`
# reruns the LLM's and the tower's MLPs (HFU/MFU 1.20). From the measured peaks, the LLM kept whole
# (`none`) with the tower fully recomputed and liger's loss should need ~121 GiB (none/none with liger
# ~141 GiB, less the tower's ~20 GiB) and rerun ~7% of the FLOPs. Each run has its own timeout; what no
# longer fits in LIMIT seconds is skipped, so the results tarball always comes back.
LIMIT=${LIMIT:-570}
source bench/gpu/lib.sh
mfu none_vfull_liger 110 --recompute none --vision-recompute full --kernels fused --loss-kernel liger
mfu selective_ga4 120 --kernels fused --grad-accum 4
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
