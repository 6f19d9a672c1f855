#!/bin/bash
# Issue 27 on one H100. The call of 2026-11-26 17:2x found the decode is not what holds ViT-L-14 at 83-85% of
# its model through the embed-images step: 11 workers did as well as 15, the machine's 16 cores (one thread
# each) were half idle, the workers' CPU per image was 4.6 ms, and the blocking-sync wait changed nothing
# (bench/results/gpu_h100.md). What the host does between batches is measured here: the step's own waits
# (wait_input, wait_device), py-spy over the main process, the card's clocks and power beside the model
# alone sustained for as long as a run, and the normalisation constants made once (the per-batch copy from
# pageable memory that waits for the stream to drain) before/after on the same machine. Prepare:
#   rm -rf .base && mkdir .base && git archive 7bbb0f3 | tar -x -C .base    (the tree before this change)
#   pip download py-spy==0.4.3 into .whl-prof (bench/results/gpu_h100.md has the command)
# then carry [".whl", ".whl-cur", ".whl-prof", ".base"] (kind nvidia-h100-x1, LIMIT=225, timeout_s 240).
LIMIT=${LIMIT:-225}
source bench/gpu/lib.sh
smi
PROF=1 EXTRA="--sustained-s 10" embed ViT-L-14-quickgelu 51200 step+draft+fast@256
SRC=.base embed ViT-L-14-quickgelu 51200 step+draft+fast@256
finish
