#!/bin/bash
# Issue 27 on one H100: ViT-L-14 stopped at 83% of its model through the embed-images step on 2026-11-26
# (bench/results/gpu_h100.md: 15 decode workers at 11.3 ms per image each, one alone at ≤ 4.4 ms). Prepare with
# `BASE_REF=7d63168 bash bench/gpu/prepare.sh` (the commit before the blocking-sync wait), then carry
# [".whl", ".whl-cur", ".base"] (kind nvidia-h100-x1, timeout_s 600, LIMIT=540). Each run records the CPU
# milliseconds per image of the main process and of the workers, the machine's busy and stolen CPU share, the
# cgroup's throttled time, whole call and steady state; the JSON the CPU topology and quota. In the order that
# matters if the call is cut:
#  - ViT-L-14 through the step at 51,200 rows: 15 workers, 11 (does the rate follow the workers, or do fewer do
#    as well: shared cores), and 15 with PIL's resize in place of fast_resize (what fast_resize gives there);
#  - the same 15-worker run on the base tree (the host spinning in the copy while the GPU computes): the
#    blocking-sync wait's before/after on the same machine;
#  - ViT-H-14 and ViT-L-14 at a task's size (102,400 rows).
LIMIT=${LIMIT:-540}
source bench/gpu/lib.sh
embed ViT-L-14-quickgelu 51200 step+draft+fast@256 step+draft+fast@256/11 step+draft@256
SRC=.base embed ViT-L-14-quickgelu 51200 step+draft+fast@256
embed ViT-H-14-quickgelu 102400 step+draft+fast@256
embed ViT-L-14-quickgelu 102400 step+draft+fast@256
finish
