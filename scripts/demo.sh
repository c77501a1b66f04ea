#!/usr/bin/env bash
# The main job, end to end: builds if needed, writes a synthetic checkpoint,
# starts a CPU expert server on it, pushes batches of requests through it over
# gRPC and prints throughput and the error against the reference MoE; then
# stops the server (SIGTERM, clean drain) and exits with the demo's status.
#
#   ./scripts/demo.sh [--preset tiny|qwen3-30b-a3b|...] [--layers N] [--batches N] [--tokens N]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=qwen3-30b-a3b layers=2 batches=30 tokens=32 threads=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --preset) preset=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --batches) batches=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
./scripts/build.sh >/dev/null
bin=${BUILD_DIR:-build}
work=$(mktemp -d /tmp/moe-demo.XXXXXX)
server_pid=""
cleanup() {
  [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "== writing a synthetic $preset checkpoint ($layers layers) to $work/model"
"$bin/core/moe-make-model" --preset "$preset" --layers "$layers" --seed 1 --out "$work/model"
echo "== starting moe-expert-server"
"$bin/cpu_expert_server/moe-expert-server" --model "$work/model" --listen 127.0.0.1:0 --insecure \
  --threads "$threads" >"$work/server.out" 2>"$work/server.log" &
server_pid=$!
for _ in $(seq 1 600); do
  grep -q "ready on" "$work/server.out" 2>/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log"; echo "server failed to start" >&2; exit 1; }
  sleep 0.1
done
addr=$(sed -n 's/.*ready on //p' "$work/server.out")
sed 's/^/   server: /' "$work/server.log"
echo "== sending $batches batches of $tokens tokens to $addr"
status=0
"$bin/client/moe-expert-demo" --server "$addr" --insecure --model "$work/model" --batches "$batches" \
  --tokens "$tokens" || status=$?
echo "== stopping the server (SIGTERM)"
kill -TERM "$server_pid"
wait "$server_pid" && echo "   server exited cleanly" || { echo "server exit status $?" >&2; status=1; }
server_pid=""
exit $status
