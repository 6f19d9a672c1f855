#!/bin/bash
# Issue 27 on one H100: the embedding loop's fix (4054c30) measured against the tree before it (2907006), on one
# card (run 2026-11-26 18:37 UTC: bench/results/gpu_h100.md, third session; ViT-L 81% -> 93%, 95% at a task's
# size, ViT-H 97%). bench/results/gpu_h100.md (second session) found ViT-L-14 held at 83-85% of its model by the loop, not the
# decode: the copy of batch k-1's embeddings waited for batch k's forward too, and the GPU idled 15% of the run
# while the host wrote results and fetched the next batch. Prepare:
#   rm -rf .base && mkdir .base && git archive 2907006 | tar -x -C .base
#   (.whl, .whl-cur: BASE_REF= bash bench/gpu/prepare.sh if missing)
# then carry [".whl", ".whl-cur", ".base"] (kind nvidia-h100-x1, LIMIT=540, timeout_s 590). In the order that
# matters if the call is cut: the GPU tests of the curation loop (bit equality of the pipelined loop with each batch
# alone); ViT-L-14 at 51,200 rows after (and with PIL's resize, now that the decode may bound it), with the
# model alone sustained; the same before; ViT-H-14 and ViT-L-14 at a task's size (102,400 rows).
LIMIT=${LIMIT:-540}
source bench/gpu/lib.sh
smi
gputests tests/curation/test_embed_decode.py tests/curation/test_assign_gpu.py
EXTRA="--sustained-s 10" embed ViT-L-14-quickgelu 51200 step+draft+fast@256 step+draft@256
SRC=.base embed ViT-L-14-quickgelu 51200 step+draft+fast@256
embed ViT-L-14-quickgelu 102400 step+draft+fast@256
embed ViT-H-14-quickgelu 102400 step+draft+fast@256
finish
