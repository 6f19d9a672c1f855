#!/usr/bin/env bash
# Compare two run folders' outputs: the `ovpipe sql` dump of every manifest both hold (rows in a total
# order, absolute paths under each run's checkout replaced by ROOT/ so two clones compare), every pack
# shard, RL export and exported model file, and each stage's losses / grad norms / learning rates (not
# the executor's own records: launch scripts, job ids, timings).
# Prints one SAME/DIFF line per item and exits 1 if any differs.
#   scripts/compare_runs.sh /path/a/runs/demo /path/b/runs/demo
set -uo pipefail
A=$(realpath "$1"); B=$(realpath "$2")
OVPIPE=${OVPIPE:-$(dirname "$0")/../.venv/bin/ovpipe}
# the checkout each run's rows name (override for a folder moved after its run: ROOT_A=/old/path)
root_a=${ROOT_A:-$(dirname "$(dirname "$A")")}; root_b=${ROOT_B:-$(dirname "$(dirname "$B")")}
diffs=0
line() { if [ "$2" = "$3" ]; then echo "$1 SAME"; else echo "$1 DIFF"; diffs=$((diffs + 1)); fi; }
dump() { "$OVPIPE" sql "$1" "$2" --format csv | sed "s#$3\b#ROOT#g" | sha256sum | cut -c1-16; }
tables() { "$OVPIPE" sql "$1" "SHOW TABLES" --format csv | tail -n +2 | sort; }
for t in $(comm -12 <(tables "$A") <(tables "$B")); do
  case $t in
    steps) continue ;;    # the executors' records (config hashes, task counts), like executor.json: not outputs
    train_metrics) q="SELECT stage, step, loss, grad_norm, lr, tokens, images, packs, samples FROM train_metrics ORDER BY ALL" ;;
    *) q="SELECT * FROM $t ORDER BY ALL" ;;
  esac
  n=$("$OVPIPE" sql "$A" "SELECT count(*) FROM $t" --format csv | tail -1)
  line "$t ($n rows)" "$(dump "$A" "$q" "$root_a")" "$(dump "$B" "$q" "$root_b")"
done
for f in $(cd "$A" && find . -type f \( -name '*.tar' -o -name '*.safetensors' -o -path './export/*' \) \
             -not -path '*/logs/*' -not -path '*/stats/*' -not -name '*.slurm' -not -name 'executor.json' \
             -not -name 'slurm_jobs.json' -not -name 'stats.json' | sort); do
  case $f in
    *.tar|*.safetensors|*.parquet) line "${f#./}" "$(sha256sum < "$A/$f")" "$(sha256sum < "$B/$f")" ;;
    *) line "${f#./}" "$(sed "s#$root_a\b#ROOT#g" "$A/$f" | sha256sum)" "$(sed "s#$root_b\b#ROOT#g" "$B/$f" | sha256sum)" ;;
  esac
done
echo "$diffs difference(s)"
[ "$diffs" -eq 0 ]
