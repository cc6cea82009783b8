#!/usr/bin/env bash
# scripts/device/h200_owed.sh: the H200 measurements issue 5 still owes (docs/perf.md), on
# the GPU machine from the repository root, each step's output under $OUT:
#   1. `stepgraph tune` of K3 TP8's two untabled per-rank shapes (560x7168, 7168x448);
#   2. the seeds-vs-measured A/B of K3 TP8's in_proj / qkv_a tactics on k3-rank-tp8's first
#      four layers at 4-64 rows (inputs from owed_inputs.py; `stepgraph diff` first);
#   3. `stepgraph bench` of k3-rank-tp8 at B = 1 and 2 (the 80 % line; BENCH_S seconds).
# Usage: scripts/device/h200_owed.sh [COMMIT] (the commit the bench report names; the copy on
# the GPU machine may have no .git).
set -uo pipefail
. scripts/device/setup.sh || exit 2
out=${OUT:-/tmp/owed}; mkdir -p "$out"
commit=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
sg() { python3 -m stepgraph "$@"; }
python3 scripts/device/owed_inputs.py "$out/inputs" || exit 2

echo "== 1. tune K3 TP8's untabled shapes"
sg compile models/kimi_k3.yaml --tp 8 -o "$out/k3-tp8.sgart" &&
  timeout 90 python3 -m stepgraph tune "$out/k3-tp8.sgart" --out "$out/k3-tp8-tuned.yaml" \
    --shapes 560x7168,7168x448 --bins 1,2,8,64 --quick --no-progress

echo "== 2. seeds vs measured, l4 at 4-64 rows"
sg compile "$out/inputs/l4.yaml" --batches 4,8,16,32,64 -o "$out/l4-a.sgart" &&
  sg compile "$out/inputs/l4.yaml" --batches 4,8,16,32,64 \
    --tactics "$out/inputs/h200-seeds.yaml" -o "$out/l4-b.sgart" &&
  { sg diff "$out/l4-a.sgart" "$out/l4-b.sgart"; true; } &&
  timeout 200 python3 scripts/ab_replay.py "$out/l4-a.sgart" "$out/l4-b.sgart" --rows 4 \
    --rows 8 --rows 16 --rows 32 --rows 64 --rounds 3 --replays 40

echo "== 3. bench k3-rank-tp8 at B = 1, 2"
sg compile models/k3_rank_tp8.yaml --batches 1,2 -o "$out/k3-rank-tp8.sgart" &&
  sg bench "$out/k3-rank-tp8.sgart" --weights random --modes stepgraph --batches 1,2 \
    --json "$out/k3-rank-tp8.json" --budget-s "${BENCH_S:-200}" --no-progress \
    --commit "$commit"
