#!/bin/bash
# The H100 (80 GB) figure: the 4B recipe at stage 1 (the projector trained: no Adam state for the rest; stage 1.5 at
# DP = 1 needs ~73 GiB of weights, gradients and Adam state before activations). kind nvidia-h100-x1.
# Stage 1 runs with recompute auto (its pick and estimate land in the JSON beside the measured peak) and with none;
# stage 1.5 must be refused by auto before any work, naming the layouts that fit.
LIMIT=${LIMIT:-300}
source bench/gpu/lib.sh
mfu stage1_auto 100 --stage 1 --kernels fused
mfu stage1_none 100 --stage 1 --kernels fused --recompute none
mfu stage15_refused 60 --stage 1.5
finish
