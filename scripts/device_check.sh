#!/usr/bin/env bash
# Runs on the GPU + AMX host (see DEVELOPERS.md): builds nothing. Unpacks the
# bundle made here by scripts/device_bundle.sh, runs every test binary, the
# end-to-end demo and the kernel benchmark, and writes logs and tables to $OUT.
#   usage (on the host): bash scripts/device_check.sh [bench flags...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
B=/tmp/moe-bundle
rm -rf "$B" && mkdir -p "$B" && tar -xJf .bundle/dev.tar.xz -C "$B" --strip-components=1
export LD_LIBRARY_PATH=$B/lib MOE_BIN_DIR=$B/bin
{
  echo "## machine"; date -u; uname -r
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|NUMA node|L3'
  grep -o -E 'amx[a-z_0-9]*|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  free -g | head -2
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

echo "## tests" | tee "$OUT/tests.txt"
for t in core_test safetensors_test kernel_test expert_server_test shm_segment_test transport_test; do
  timeout 300 "$B/bin/$t" > "/tmp/$t.log" 2>&1
  rc=$?
  echo "$t: rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "/tmp/$t.log" | tr '\n' ' ')" | tee -a "$OUT/tests.txt"
  [[ $rc -ne 0 ]] && grep -E "Failure|Expected|Which|FAILED|error" "/tmp/$t.log" | head -40 >> "$OUT/tests.txt"
done

echo "## demo" | tee "$OUT/demo.txt"
W=$(mktemp -d)
"$B/bin/moe-make-model" --preset qwen3-30b-a3b --layers 2 --seed 1 --out "$W/model" >> "$OUT/demo.txt" 2>&1
"$B/bin/moe-expert-server" --model "$W/model" --listen 127.0.0.1:0 --insecure > "$W/srv.out" 2> "$W/srv.log" &
SP=$!
for i in $(seq 1 300); do grep -q "ready on" "$W/srv.out" && break; sleep 0.1; done
ADDR=$(sed -n 's/.*ready on //p' "$W/srv.out")
cat "$W/srv.log" >> "$OUT/demo.txt"
"$B/bin/moe-expert-demo" --server "$ADDR" --insecure --model "$W/model" --batches 50 --tokens 8 >> "$OUT/demo.txt" 2>&1
"$B/bin/moe-expert-demo" --server "$ADDR" --insecure --model "$W/model" --batches 20 --tokens 256 --check 1 >> "$OUT/demo.txt" 2>&1
kill -TERM $SP; wait $SP; echo "server exit: $?" >> "$OUT/demo.txt"
tail -8 "$OUT/demo.txt"

echo "## transport"
timeout 300 "$B/bin/transport" > "$OUT/transport.md" 2>> "$OUT/logs.txt"
echo "transport rc=$?"
cat "$OUT/transport.md"

echo "## expert_kernels"
timeout 420 "$B/bin/expert_kernels" "$@" > "$OUT/expert_kernels.md" 2>> "$OUT/logs.txt"
echo "expert_kernels rc=$?"
cat "$OUT/expert_kernels.md"
