#!/usr/bin/env bash
# One benchmark at several commits, in the same command on the same machine ("before and
# after the change in the same run"). Each earlier commit travels as a `git archive` tarball
# in .before/ (the device machine gets the working tree, not the history):
#
#   git archive -o .before/8aa6fe9.tar 8aa6fe9            # here, once per commit
#   bash bench/compare_commits.sh bench/latency.py --batch-sizes 1,8,64 --no-baseline
#   ROUNDS=2 bash bench/compare_commits.sh bench/throughput.py ...   # both orders
#
# For each .before/SHA.tar the tree is unpacked, installed (non-editable) into its own
# folder, and SCRIPT runs from that tree with that folder first on PYTHONPATH, so `kiln`
# is that commit's; then SCRIPT runs at the working tree. Each run writes
# $OUT/compare-SHA.json (the working tree: compare-HEAD.json; with ROUNDS > 1,
# compare-SHA-rN.json) and its log under $LOG_DIR (default $OUT); the kiln module each run
# imported is printed first, so a run that silently used the wrong tree shows.
#
# ROUNDS=2 runs every tree twice, the second round in the reverse order: on the H200 a tree's
# place in the command moved its offline figure by 1.5-2.7% (bench/RESULTS.md, O6-O7).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
LOG_DIR=${LOG_DIR:-$OUT}
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT" "$LOG_DIR"
PY=${PYTHON:-python3}
SCRIPT=$1; shift
status=0

run_at() {  # label, tree, pythonpath prefix
  local label=$1 tree=$2 prefix=$3
  echo "=== $label: $SCRIPT ${ARGS[*]}"
  (cd "$tree" && PYTHONPATH="$prefix${PYTHONPATH:+:$PYTHONPATH}" \
     $PY -c "import kiln.runtime.engine as m; print('kiln from', m.__file__)" &&
   PYTHONPATH="$prefix${PYTHONPATH:+:$PYTHONPATH}" $PY "$SCRIPT" "${ARGS[@]}" --out "$OUT/compare-$label.json") \
    > "$LOG_DIR/compare-$label.log" 2>&1 || status=1
  grep -E '^kiln from|^\[|rror' "$LOG_DIR/compare-$label.log" | tail -12
}

ARGS=("$@")
labels=() trees=() prefixes=()
for tar in .before/*.tar; do
  [ -e "$tar" ] || continue
  sha=$(basename "$tar" .tar)
  tree=/tmp/kiln-before-$sha site=/tmp/kiln-before-site-$sha
  rm -rf "$tree" "$site" && mkdir -p "$tree" && tar -xf "$tar" -C "$tree" || { status=1; continue; }
  $PY -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" "$tree" > "$LOG_DIR/install-$sha.log" 2>&1 \
    || { echo "=== $sha: install failed"; tail -5 "$LOG_DIR/install-$sha.log"; status=1; continue; }
  labels+=("$sha") trees+=("$tree") prefixes+=("$site")
done
labels+=(HEAD) trees+=("$PWD") prefixes+=("$PWD")
n=${#labels[@]}
for ((round = 1; round <= ROUNDS; round++)); do
  for ((j = 0; j < n; j++)); do
    i=$(( round % 2 == 1 ? j : n - 1 - j ))  # odd rounds: the befores first; even rounds: HEAD first
    suffix=$([ "$ROUNDS" -gt 1 ] && echo "-r$round" || true)
    run_at "${labels[i]}$suffix" "${trees[i]}" "${prefixes[i]}"
  done
done
exit $status
