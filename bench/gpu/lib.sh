# Sourced by the device scripts beside it (run from the repository root on the device machine, $OUT set,
# LIMIT = the call's seconds): the wheels installed (.whl, and .whl-cur where carried), the card, versions and CPU
# topology logged, and `mfu NAME TIMEOUT ARGS...` (one 4B bench_mfu run on a fresh copy of .gpu/run8k, skipped
# when it no longer fits in LIMIT), `embed MODEL ROWS VARIANTS...` (one bench_curation --gpu process), `tiny`
# (the tiny recipe's fp32 and bf16 losses), `gputests`, `layouts` (issue 41's layouts on one card) and `finish`. `SRC=.base mfu|embed ...` runs the code in
# .base (prepare.sh's BASE_REF) on the same card, its JSON named base_*. Every run's JSON and the log land in $OUT/results.tgz after each run,
# so a cut call loses nothing. Every timeout also kills (-k): a megatron run's exit (its checkpoint save) once
# outlived a SIGTERM by three minutes.
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $(ls .whl-cur/*.whl .whl-prof/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
R=/tmp/devres/r; rm -rf $R; mkdir -p $R; LOG=$OUT/log.txt   # only the tarball and the log come back (8 files at most)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; nproc; lscpu | grep -E "^(Model name|Thread|Core|Socket|NUMA node\(s\))"; git log -1 --format=%H 2>/dev/null; } >> $LOG 2>&1
save() { cp $LOG $R/log.txt; tar -C /tmp/devres -czf $OUT/results.tgz r; }
mfu() {  # name timeout args...
  local name=${SRC:+base_}$1 t=$2 src=$PWD/${SRC:-.}; shift 2
  if [ $(left) -lt $((t + 15)) ]; then echo "=== $name skipped: $(left)s left" >> $LOG; return; fi
  rm -rf /tmp/run-$name; cp -r .gpu/run8k /tmp/run-$name
  echo "=== $name: $* (at $(( $(date +%s) - T0 ))s)" >> $LOG
  (cd $src && PYTHONPATH=/tmp/site:$src timeout -k 10 $t python3 -m bench.bench_mfu --run-dir /tmp/run-$name --recipe llava-ov-1.5-4b --steps 8 --warmup 2 --out $R/$name.json "$@") 2>&1 | grep -v "Warning\|warn(\|^\[rank0\]:   " >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; rm -rf /tmp/run-$name; save
}
embed() {  # model rows variants... : one bench_curation --gpu process (the GEMM probe, the JPEGs, the model once);
  # SRC=.base embed ... runs prepare.sh's BASE_REF tree instead (a before figure on the same machine);
  # EXTRA="..." adds bench arguments; PROF=1 runs it under py-spy (carry .whl-prof: the main process's
  # threads, idle stacks included, sampled without pausing it) into pyspy_N.txt
  local m=$1 n=$2 src=$PWD/${SRC:-.} tag=${SRC:+base_} spy=; shift 2
  [ $(left) -gt 100 ] || { echo "=== ${tag}embed $m skipped: $(left)s left" >> $LOG; return; }
  EMBEDN=$(( EMBEDN + 1 ))
  CA="--models $m --images $n --distinct 2048 --batch-size 256 --embed $* --skip assign${EXTRA:+ $EXTRA}"
  [ -n "${PROF:-}" ] && [ -x /tmp/site/bin/py-spy ] && spy="/tmp/site/bin/py-spy record --idle --threads --nonblocking -r 50 -f raw -o $R/pyspy_$EMBEDN.txt --"
  echo "=== ${tag}curation embed $m, $n rows: $* ${EXTRA:-}${spy:+ (py-spy)} (at $(( $(date +%s) - T0 ))s)" >> $LOG
  (cd $src && PYTHONPATH=/tmp/site:$src timeout -k 5 $(( $(left) - 8 )) $spy python3 -m bench.bench_curation --gpu $CA \
    --command "python -m bench.bench_curation --gpu $CA" --json $R/${tag}embed_${m}_$EMBEDN.json) 2>&1 \
    | grep -v "Warning\|warn(\|^INFO:root" >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; save
}
EMBEDN=0
smi() {  # the card's SM clock, power, temperature, utilisation and throttle reasons every second, in the background
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
    --format=csv -l 1 > $R/smi.csv 2>&1 & SMI=$!
  echo "smi sampling from $(( $(date +%s) - T0 ))s (pid $SMI)" >> $LOG
}
tiny() {  # the tiny recipe's losses over 3 steps, fp32 then bf16 (issue 23: bf16 within its tolerance of fp32)
  if [ $(left) -lt 110 ]; then echo "=== tiny skipped: $(left)s left" >> $LOG; return; fi
  echo "=== tiny fp32 / bf16, 3 steps (at $(( $(date +%s) - T0 ))s)" >> $LOG
  local p flag
  for p in fp32 bf16; do
    rm -rf /tmp/t$p; cp -r .gpu/run8k /tmp/t$p; flag=; [ $p = fp32 ] && flag=--fp32
    timeout -k 5 50 python3 -m pretrain.train --run-dir /tmp/t$p --recipe tiny --stage 1.5 --steps 3 --micro-batch 1 \
      --lr 1e-3 $flag --metrics-out $R/tiny_$p.json 2>&1 | grep "consumed\|Error" >> $LOG
  done
  python3 -c "import json; m = {p: [s['loss'] for s in json.load(open('$R/tiny_' + p + '.json'))['metrics']] for p in ('fp32', 'bf16')}; print('tiny losses', m, 'max |bf16 - fp32|', max(abs(a - b) for a, b in zip(m['fp32'], m['bf16'])))" >> $LOG 2>&1
  save
}
gputests() {  # [test files...]: the tests marked gpu (they skip on a CPU); default: every file that has some
  if [ $(left) -lt 60 ]; then echo "=== gpu tests skipped: $(left)s left" >> $LOG; return; fi
  local files=${*:-"tests/pretrain/test_fused.py tests/pretrain/test_packed_attention_gpu.py tests/curation/test_assign_gpu.py tests/curation/test_embed_decode.py"}
  echo "=== gpu tests: $files (at $(( $(date +%s) - T0 ))s)" >> $LOG
  timeout -k 5 $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu $files 2>&1 | tail -15 >> $LOG
  save
}
layouts() {  # issue 41 item 1: every parallel layout of tests/pretrain/test_parallel_parity.py on this one card (the
  # ranks share it over host-staged gloo: pretrain/trainer/host_collectives.py), fp32 and bf16 + distributed optimizer,
  # against the 1-rank GPU runs; each run's metrics.json and stage.json (its "collectives") into $R/layouts/
  if [ $(left) -lt 150 ]; then echo "=== layouts skipped: $(left)s left" >> $LOG; return; fi
  echo "=== layouts on one card (at $(( $(date +%s) - T0 ))s)" >> $LOG
  rm -rf /tmp/lay
  timeout -k 5 $(( $(left) - 15 )) python3 -m pytest -q -p no:cacheprovider -W ignore -rA --basetemp=/tmp/lay \
    tests/pretrain/test_host_collectives.py tests/pretrain/test_parallel_parity.py 2>&1 | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed|Error" | tail -40 >> $LOG
  mkdir -p $R/layouts
  for d in /tmp/lay/par*/*/; do
    n=$(basename $d)
    [ -f $d/metrics.json ] && cp $d/metrics.json $R/layouts/$n.metrics.json
    [ -f $d/pretrain/stage-1.5/stage.json ] && cp $d/pretrain/stage-1.5/stage.json $R/layouts/$n.stage.json
  done
  python3 bench/gpu/layouts_table.py $R/layouts >> $LOG 2>&1
  save
}
finish() {
  [ -n "${SMI:-}" ] && kill $SMI 2>/dev/null
  echo "=== done at $(( $(date +%s) - T0 ))s" >> $LOG; save
  grep -E "^===|^rc|mfu_median|peak_mem|passed|failed|img_s|startup|CPU ms|Core|Thread|sustained" $LOG | tail -40
}
