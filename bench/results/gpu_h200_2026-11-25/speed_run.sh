#!/bin/bash
# ovpipe issue 23 GPU session (engineer "speed"): baseline (main + GQA repeat patch) and after, 4B stage 1.5, 8K packs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
ROOT=$PWD; RUN=$ROOT/.gpu/run8k; LOG=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } >> $LOG 2>&1
cd $ROOT/.gpu/speed
for rc in ${RECOMPUTES:-selective none full}; do
  rm -rf /tmp/run-$rc; cp -r $RUN /tmp/run-$rc
  echo "=== after $rc" >> $LOG
  PYTHONPATH=$PWD:/tmp/site timeout ${T_AFTER:-170} python3 -m bench.bench_mfu --run-dir /tmp/run-$rc --recipe llava-ov-1.5-4b --steps 8 --warmup 2 --recompute $rc --profile 1 --out $OUT/after_$rc.json >> $LOG 2>&1
  echo "rc $?" >> $LOG
done
if [ -z "$SKIP_BASE" ]; then
cd $ROOT/.gpu/speed-main; rm -rf /tmp/run-main; cp -r $RUN /tmp/run-main
echo "=== before full" >> $LOG
PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m bench.bench_mfu --run-dir /tmp/run-main --recipe llava-ov-1.5-4b --steps 6 --warmup 2 --recompute full --profile 1 --out $OUT/before_full.json >> $LOG 2>&1
echo "rc $?" >> $LOG
fi
cd $ROOT/.gpu/speed
if [ -z "$SKIP_TINY" ]; then
for p in fp32 bf16; do rm -rf /tmp/t$p; cp -r $RUN /tmp/t$p; done
echo "=== tiny" >> $LOG
PYTHONPATH=$PWD:/tmp/site timeout 120 python3 -m pretrain.train --run-dir /tmp/tfp32 --recipe tiny --stage 1.5 --steps 3 --micro-batch 1 --lr 1e-3 --fp32 --metrics-out $OUT/tiny_fp32.json >> $LOG 2>&1
PYTHONPATH=$PWD:/tmp/site timeout 120 python3 -m pretrain.train --run-dir /tmp/tbf16 --recipe tiny --stage 1.5 --steps 3 --micro-batch 1 --lr 1e-3 --metrics-out $OUT/tiny_bf16.json >> $LOG 2>&1
echo "=== gpu tests" >> $LOG
PYTHONPATH=$PWD:/tmp/site timeout 120 python3 -m pytest -q -p no:cacheprovider tests/pretrain/test_packed_attention_gpu.py tests/pretrain/test_packed_attention.py >> $LOG 2>&1
fi
tail -c 3000 $LOG
