#!/usr/bin/env bash
# scripts/device/suite.sh NAME LIMIT PYTEST-ARGS...: the GPU tests named, on the GPU machine,
# stopped after LIMIT seconds; the whole log goes to $OUT/NAME.log (so a run cut short still
# brings back what passed), the failures and counts to stdout.
set -uo pipefail
name=$1; limit=$2; shift 2
. scripts/device/setup.sh || exit 2
log=${OUT:-/tmp}/$name.log
timeout "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short --durations=8 "$@" \
  2>&1 | tee "$log" | grep -v " PASSED\| SKIPPED"
echo "$name: $(grep -c ' PASSED' "$log") passed, $(grep -c ' FAILED\| ERROR' "$log") failed," \
  "$(grep -c ' SKIPPED' "$log") skipped"
