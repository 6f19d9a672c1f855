#!/bin/bash
# The second H200 call of 2026-11-26 (carry [".whl", ".gpu"], timeout_s 330): the first call found the LLM kept
# whole with the tower fully recomputed at 113.6 GiB (not the 121-134 GiB estimated), so the loss and the tower's
# recompute are tried around it, at grad-accum 4 (one optimizer step per four packs) and 1.
LIMIT=${LIMIT:-300}
source bench/gpu/lib.sh
mfu none_vfull_megatron_ga4 70 --recompute none --vision-recompute full --kernels fused --loss-kernel megatron --grad-accum 4 --steps 6
mfu none_vsel_megatron_ga4 70 --recompute none --vision-recompute selective --kernels fused --loss-kernel megatron --grad-accum 4 --steps 6
mfu none_vsel_liger_ga4 70 --recompute none --vision-recompute selective --kernels fused --loss-kernel liger --grad-accum 4 --steps 6
mfu none_vfull_megatron 60 --recompute none --vision-recompute full --kernels fused --loss-kernel megatron
finish
