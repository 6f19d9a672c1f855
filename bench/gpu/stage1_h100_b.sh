#!/bin/bash
# The second H100 call, on the same warm machine when stage1_h100.sh was cut (carry [".whl", ".gpu", ".base"]):
# its tail, in the same order. ONLY="base tiny ga4 refused tests" picks a subset.
LIMIT=${LIMIT:-300}
ONLY=${ONLY:-base tiny ga4 refused tests}
source bench/gpu/lib.sh
want() { [[ " $ONLY " == *" $1 "* ]]; }
want base && mfu base_stage1 120 --stage 1 --recompute full --profile 1
want tiny && tiny
want ga4 && mfu stage1_auto_ga4 90 --stage 1 --kernels fused --grad-accum 4 --steps 6
want refused && mfu stage15_refused 45 --stage 1.5
want tests && gputests
finish
