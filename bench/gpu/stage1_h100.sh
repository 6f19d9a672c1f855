#!/bin/bash
# The H100 (80 GB) figure: the 4B recipe at stage 1 (the projector trained: no Adam state for the rest; stage 1.5 at
# DP = 1 needs ~74 GiB of weights, gradients and Adam state before activations). kind nvidia-h100-x1.
LIMIT=${LIMIT:-300}
source bench/gpu/lib.sh
mfu stage1 100 --stage 1 --kernels fused
mfu stage1_none 100 --stage 1 --kernels fused --recompute none
finish
