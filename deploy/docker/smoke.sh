#!/usr/bin/env bash
# Runs INSIDE the built image (scripts/container-check.sh mounts it there): a
# short session on loopback with the image's own binaries — moe-coordinator,
# one moe-expert-server (shared memory and gRPC), one moe-gpu-worker (cpu
# backend, a quarter of the experts cached, so answers mix cached experts
# and misses served by the expert server) registered with the coordinator — and one checking client
# (moe-expert-demo --worker) whose ForwardLayer answers must match the
# reference MoE (bf16 tolerance 1e-2). Exit 0 only if they do.
set -euo pipefail
model=${SMOKE_MODEL:-synthetic:demo:layers=2:seed=7}
dir=$(mktemp -d /tmp/moe-smoke.XXXXXX)
base=$(( 20000 + (RANDOM % 2000) * 10 ))
coord=127.0.0.1:$base server=127.0.0.1:$((base + 1)) worker=127.0.0.1:$((base + 2))
pids=()
stop() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap stop EXIT
# Waits (bounded) for a process's "ready" line; fails with its log otherwise.
wait_ready() {
  local name=$1 pid=$2 i
  for i in $(seq 1 600); do
    grep -q "ready on" "$dir/$name.log" && { echo "smoke: $(grep -m1 'ready on' "$dir/$name.log")"; return 0; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "smoke: $name did not become ready; its log:" >&2
  tail -20 "$dir/$name.log" >&2
  return 1
}

for b in moe-coordinator moe-expert-server moe-gpu-worker moectl moe-expert-demo; do
  "$b" --help > "$dir/help.txt" 2>&1 || { cat "$dir/help.txt" >&2; echo "smoke: $b --help failed" >&2; exit 1; }
  echo "smoke: $b --help: $(head -n1 "$dir/help.txt")"
done

moe-coordinator --insecure --insecure-admin --listen "$coord" --state-file "$dir/coordinator.state" > "$dir/coordinator.log" 2>&1 &
pids+=($!); wait_ready coordinator $!
moe-expert-server --insecure --model "$model" --listen "$server" --shm-socket "$dir/expert.sock" \
  --threads 2 --coordinator "$coord" > "$dir/server.log" 2>&1 &
pids+=($!); wait_ready server $!
moe-gpu-worker --insecure --model "$model" --device cpu --servers "unix://$dir/expert.sock" \
  --cache-experts-per-layer 8 --listen "$worker" --coordinator "$coord" --cpu-threads 1 > "$dir/worker.log" 2>&1 &
pids+=($!); wait_ready worker $!
moe-expert-demo --insecure --worker "$worker" --model "$model" --batches 4 --tokens 8 --check 4
moectl status --insecure --coordinator "$coord"
echo "smoke: OK"
