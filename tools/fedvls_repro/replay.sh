#!/usr/bin/env bash
# The replay (issue 25): the authors' own MNIST client data, exported by export.py, trained on by the
# authors' code (their pipeline) and by fedlt (the exported arrays + partition), one run at a time.
# Run after prepare.sh. Each run is skipped when its curve already exists (rerun: delete the curve).
# Usage: replay.sh [WORK] [SEEDS...]   (SEEDS of fedlt's side, default 0; e.g. "0 1" for the spread)
# Env: PY (a python with scipy, scikit-learn and fedlt), CORE (the core runs are pinned to, default 1)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(cd "${1:-/tmp/fedvls_repro}" && pwd)"; shift $(( $# >= 1 ? 1 : 0 )); seeds=("${@:-0}")
py="${PY:-python}"; pin=(taskset -c "${CORE:-1}"); export OMP_NUM_THREADS=1
data="$work/authors-data"

[ -f "$data/partition.npz" ] || "${pin[@]}" "$py" "$here/export.py" --work "$work"

authors() {  # authors() <Algo> [run_authors flags...]
  local name="authors-$1-0.05-authorsdata"
  [ -f "$work/$name.json" ] && return
  "${pin[@]}" "$py" "$here/run_authors.py" --work "$work" --data authors --algo "$@" \
    --out "$work/$name.json" > "$work/$name.log" 2>&1
}
fedlt() {  # fedlt() <algo> <seed> [run_fedlt flags...]
  local algo="$1" seed="$2"; shift 2
  local name="fedlt-$algo-0.05-authorsdata$([ "$seed" = 0 ] || echo "-seed$seed")"
  [ -f "$work/$name/curve.json" ] && return
  (cd "$here" && "${pin[@]}" "$py" run_fedlt.py --algo "$algo" --seed "$seed" --dataset arrays \
    --data-root "$data/mnist-authors.npz" --partition-file "$data/partition.npz" "$@" \
    --out "$work/$name" > "$work/$name.log" 2>&1)
}

# pairs first (a shared machine may not finish everything): FedVLS on both sides, then FedAvg
authors FedVLS
fedlt fedvls "${seeds[0]}"
authors FedAvg --weight-decay 1e-5  # the paper's FedAvg weight decay; FedVLS's client forces 0
fedlt fedavg "${seeds[0]}" --weight-decay 1e-5
for seed in "${seeds[@]:1}"; do
  fedlt fedvls "$seed"
  fedlt fedavg "$seed" --weight-decay 1e-5
done
"$py" "$here/collect.py" --work "$work"
