#!/bin/bash
# Issue 27 on one H100 (carry [".whl", ".whl-cur"] from bench/gpu/prepare.sh; kind nvidia-h100-x1, timeout_s 600,
# LIMIT=540): embed-images through the step with a GPU's defaults, and why ViT-L-14 stopped at 83% of its model
# on 2026-11-26 (gpu_h100.md: 15 workers at 11.3 ms per image each, one alone at ≤ 4.4 ms). Each run records the
# CPU milliseconds per image of the main process and of the workers, the machine's busy and stolen CPU share and
# the cgroup's throttled time over the run; the JSON the CPU topology and quota:
#  - ViT-L-14 at a task's size (102,400 rows), 15 workers: the whole-call figure;
#  - ViT-L-14 at 51,200 rows with 7 and 11 workers: whether the rate follows the workers (a CPU-bound decode)
#    or not (a bound in the main process), and whether 8 physical cores cap it; then 15 workers with PIL's
#    resize in place of fast_resize, on the same CPUs;
#  - ViT-H-14 at a task's size.
LIMIT=${LIMIT:-540}
source bench/gpu/lib.sh
embed ViT-L-14-quickgelu 102400 step+draft+fast@256
embed ViT-L-14-quickgelu 51200 step+draft+fast@256/7 step+draft+fast@256/11 step+draft@256
embed ViT-H-14-quickgelu 102400 step+draft+fast@256
finish
