#!/usr/bin/env bash
# Prepare everything the side-by-side runs read, under WORK (default /tmp/fedvls_repro), offline:
#   WORK/rawdata/MNIST/raw/*-ubyte  the four idx files, uncompressed: torchvision's MNIST layout under
#                                   the root the authors' code reads (datadir + "rawdata")
#   WORK/authors/system           a temporary export of the authors' code, patched by patch_authors.sh
#   WORK/partition-<beta>.npz     fedlt's dirichlet partition (10 clients, seed 0) for each beta
# Usage: prepare.sh <authors git dir from the fetch tool> [WORK] [betas...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
authors_git="$1"; work="${2:-/tmp/fedvls_repro}"; shift $(( $# >= 2 ? 2 : 1 )); betas=("${@:-0.05}")
[ ${#betas[@]} -eq 0 ] && betas=(0.05)
fedlt="${FEDLT:-fedlt}"
mnist="${MNIST_IDX:-$here/../../../shared/data/mnist}"
mkdir -p "$work/rawdata/MNIST/raw" "$work/authors"
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  gunzip -c "$mnist/$f.gz" > "$work/rawdata/MNIST/raw/$f"  # where the header says, and mkdir made
done
rm -rf "$work/authors/system"
git -C "$authors_git" archive HEAD system | tar -x -C "$work/authors"
echo "authors' commit: $(git -C "$authors_git" rev-parse HEAD)" | tee "$work/authors/COMMIT"
"$here/patch_authors.sh" "$work/authors/system"
for beta in "${betas[@]}"; do
  "$fedlt" partition --dataset mnist --partition dirichlet --beta "$beta" --clients 10 --seed 0 \
    --save "$work/partition-$beta.npz" --max-rows 0 > "$work/partition-$beta.txt"
done
echo "prepared $work"
