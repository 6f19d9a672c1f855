# Sourced by the device scripts beside it (run from the repository root on the device machine, $OUT set,
# LIMIT = the call's seconds): the wheels installed, the card and versions logged, and `mfu NAME TIMEOUT
# ARGS...` (one 4B bench_mfu run on a fresh copy of .gpu/run8k, skipped when it no longer fits in LIMIT) and
# `finish`. A run named base_* runs the code in .base (prepare.sh's BASE_REF) on the same card. Every run's JSON and the log land in $OUT/results.tgz after each run, so a cut call loses nothing.
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
R=/tmp/devres/r; rm -rf $R; mkdir -p $R; LOG=$OUT/log.txt   # only the tarball and the log come back (8 files at most)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; nproc; git log -1 --format=%H 2>/dev/null; } >> $LOG 2>&1
save() { cp $LOG $R/log.txt; tar -C /tmp/devres -czf $OUT/results.tgz r; }
mfu() {  # name timeout args...
  local name=$1 t=$2; shift 2
  if [ $(left) -lt $((t + 15)) ]; then echo "=== $name skipped: $(left)s left" >> $LOG; return; fi
  rm -rf /tmp/run-$name; cp -r .gpu/run8k /tmp/run-$name
  echo "=== $name: $* (at $(( $(date +%s) - T0 ))s)" >> $LOG
  local src=$PWD; case $name in base_*) src=$PWD/.base;; esac
  (cd $src && PYTHONPATH=/tmp/site:$src timeout $t python3 -m bench.bench_mfu --run-dir /tmp/run-$name --recipe llava-ov-1.5-4b --steps 8 --warmup 2 --out $R/$name.json "$@") 2>&1 | grep -v "Warning\|warn(\|^\[rank0\]:   " >> $LOG
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s" >> $LOG; rm -rf /tmp/run-$name; save
}
finish() {
  echo "=== done at $(( $(date +%s) - T0 ))s" >> $LOG; save
  grep -E "^===|^rc|mfu_median|peak_mem|passed|failed|img_s|startup" $LOG | tail -40
}
