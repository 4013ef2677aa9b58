#!/usr/bin/env bash
# Writes tests/fixtures/prev_release/: a run directory written by an earlier fedlt, which
# tests/test_upgrade.py resumes with the current one (docs/runs.md, "Format versions").
#
#   tools/prev_release_run.sh COMMIT [DEST]      e.g. tools/prev_release_run.sh fdcbc6a
#
# It checks COMMIT out in a temporary git worktree and runs, with that tree's fedlt:
#   run/                       a 1-round run (complete; the test extends it to 2 rounds)
#   two_rounds.metrics.jsonl   the same settings run for 2 rounds uninterrupted
# The MLP reads MNIST resized to 8×8 so that the checkpoint stays small (~220 KB); MNIST itself
# ships with fedlt and is not copied.
set -euo pipefail
commit=${1:?usage: tools/prev_release_run.sh COMMIT [DEST]}
here=$(cd "$(dirname "$0")/.." && pwd)
dest=${2:-$here/tests/fixtures/prev_release}
tree=$(mktemp -d /tmp/fedlt-prev-XXXXXX)
work=$(mktemp -d /tmp/fedlt-prev-run-XXXXXX)
trap 'git -C "$here" worktree remove --force "$tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$here" worktree add --detach "$tree" "$commit" >/dev/null
[ -e "$tree/fedlt/cli" ] || ln -s ../cli "$tree/fedlt/cli"  # the development layout: fedlt.cli is cli/
full=$(git -C "$tree" rev-parse HEAD)
settings=(--algo fedavg --model mlp --augment "resize(size=8)" --clients 2 --participation 1
          --train-limit 200 --test-limit 100 --local-iters 2 --partition dirichlet --beta 0.5 --min-size 5
          --eval-every 1 --client-test "matched(size=20)" --client-eval expected --client-eval global_local
          --threads 1 --quiet)
shown=$(printf "%q " "${settings[@]}")
cd "$work"
PYTHONPATH="$tree" OMP_NUM_THREADS=1 python -m fedlt.cli run "${settings[@]}" --rounds 1 --out run >/dev/null
PYTHONPATH="$tree" OMP_NUM_THREADS=1 python -m fedlt.cli run "${settings[@]}" --rounds 2 --out two >/dev/null
rm -rf "$dest" && mkdir -p "$dest"
cp -r run "$dest/run"
cp two/metrics.jsonl "$dest/two_rounds.metrics.jsonl"
cat > "$dest/README.md" <<EOF
# A run directory written by an earlier fedlt

Written by fedlt at commit \`$full\` with \`tools/prev_release_run.sh ${commit}\`:

    fedlt run ${shown}--rounds 1 --out run
    fedlt run ${shown}--rounds 2 --out two   # two_rounds.metrics.jsonl is two/metrics.jsonl

\`tests/test_upgrade.py\` resumes \`run/\` with \`--rounds 2\` using the current fedlt: it must
finish, and its metrics (timings aside) must equal \`two_rounds.metrics.jsonl\` bit for bit.
EOF
echo "wrote $dest from $full"
