#!/usr/bin/env bash
# Runs every CPU test tier: unit tests, then the multi-rank tiers under torchrun with gloo.
# Usage: bash tests/run_tiers.sh   (from the repository root; extra args go to the unit run)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "== unit tests"
python -m pytest -q "$@"

# Multi-rank tiers: every rank runs the same tests; -p no:cacheprovider keeps ranks from racing
# on .pytest_cache. Each world size exercises a different rank/offset layout.
for n in 2 3 4; do
  echo "== dist tests, $n ranks (gloo)"
  torchrun --standalone --nproc-per-node "$n" -m pytest -q -m dist -p no:cacheprovider tests/
done
