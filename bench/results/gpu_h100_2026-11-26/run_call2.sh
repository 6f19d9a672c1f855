#!/bin/bash
# Call 2 of 2026-11-26 (carry [".whl"] with duckdb-2.0.1 added, kind nvidia-h100-x1, timeout_s 200): call 1's two
# embed runs through the step again, both models in one process at 51,200 rows (the device time left).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && C="--models ViT-L-14-quickgelu ViT-H-14-quickgelu --images 51200 --distinct 2048 --batch-size 256 --embed step+draft+fast@256 --skip assign" && timeout 188 python3 -m bench.bench_curation --gpu $C --command "python -m bench.bench_curation --gpu $C" --json $OUT/embed_step.json 2>&1 | grep -v "Warning\|warn(" | tee $OUT/log.txt
