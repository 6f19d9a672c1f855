#!/bin/bash
# The embed-images step on one H100, the figures of bench/results/h100.md: the tree against the one in .base on
# the same card (a before figure). ViT-L-14 is bound by the embedding loop when batch k-1's embeddings wait for
# batch k's forward as well (the GPU then idles while the host writes results and fetches the next batch), so the
# runs record the host's waits and the model alone sustained beside the step. Prepare:
#   rm -rf .base && mkdir .base && git archive <the commit to compare against> | tar -x -C .base
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
