#!/usr/bin/env bash
# The main job, end to end: builds if needed, then runs moe-demo, which starts
# the coordinator, one CPU expert server (shared memory) and one GPU worker
# (cuda when a GPU is usable, else the cpu backend) on a small synthetic model,
# drives a routing workload whose hot set drifts through the client library
# (live progress line), asks the coordinator for placements with moectl,
# prints per-layer hit rates before/after rebalancing, the CPU's share of the
# misses and the max error against the reference MoE, stops every process and
# exits 0 (1 if the error exceeds 1e-2).
#
#   ./scripts/demo.sh [--preset demo] [--layers 8] [--steps 400] [--tokens 16] [--cache C]
#                     [--trace FILE] [--device auto|cuda|cpu] [--help]
#   e.g. ./scripts/demo.sh --trace ../shared/data/traces/mixtral-8x7b-humaneval.jsonl.xz --steps 300 --cache 2
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BUILD_DIR:-build}
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]] && [[ -x "$bin/demo/moe-demo" ]]; then
  sed -n '2,13p' "$0"; echo; exec "$bin/demo/moe-demo" --help
fi
./scripts/build.sh >/dev/null
exec "$bin/demo/moe-demo" "$@"
