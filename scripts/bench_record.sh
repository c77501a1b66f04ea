#!/usr/bin/env bash
# The benchmark of record: bench/moe_layer on recorded routing at each trace's
# model geometry, as many layers as the host holds, then Qwen3-30B-A3B at full
# depth (48 layers) and DeepSeek-V3 (4 layers) for decode and prompts. Every
# row is a mode of the worker — ours (the worker's defaults: what a user
# gets), ours-graph, ours-cpu, lru-copy, copy-all — with its causal and
# oracle floors; moe_layer exits 3 when a step beats its causal floor.
#
#   scripts/bench_record.sh [SET ...]    (default: every set, in this order)
#     olmoe mixtral kimi        the traces (../shared/data/traces) at T = 1, 8, 32, caches 25/50%
#     qwen3-decode              48 layers, Zipf routing, T = 1, 8 at 25%, with the ceiling
#     qwen3-prompt              48 layers, prompts of 512/2048/8192 tokens (chunks of 2048), 0/25%
#     deepseek                  4 layers, T = 1, 8 and prompts of 512/2048, 25%
#     llama                     beside the llama.cpp peer in this call: Qwen3-30B-A3B at LLAMA_LAYERS (16)
#                               layers, uniform routing (the peer's), decode T = 1, 8, 32 and prompts of
#                               512/2048 at 0/25%; then ../shared/peers/llama/peer.sh on the same geometry
#                               (bf16, or Q8_0 for DTYPE=int8) and bench/peer_join.py's table of both
#                               with llama.cpp / causal floor beside each row (not in the default sets)
#
# Environment: BIN (the folder holding moe_layer and moe-expert-server;
# default: the build tree), TRACES (default ../shared/data/traces), OUT
# (default /tmp/bench_record: record.md gets one table per run, in order,
# and record.log the runs' logs), DTYPE (bf16; int8, int4: the experts'
# format), RUNS (3), and per set <SET>_LAYERS / <SET>_BATCHES / <SET>_CACHE
# (e.g. KIMI_LAYERS=13: fewer layers than memory allows, to fit a time budget); for
# `llama`: PEER (peer.sh; default ../shared/peers/llama/peer.sh), JOIN (default
# bench/peer_join.py) and PYTHON (default /opt/torch/.venv/bin/python3, else python3).
# Prints each run's summary and exits non-zero when any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench_record}
TRACES=${TRACES:-../shared/data/traces}
DTYPE=${DTYPE:-bf16}
RUNS=${RUNS:-3}
if [[ -z "${BIN:-}" ]]; then
  b=${BUILD_DIR:-build}
  BIN=$(mktemp -d)
  trap 'rm -rf "$BIN"' EXIT
  ln -s "$PWD/$b/bench/moe_layer" "$BIN/moe_layer"
  ln -s "$PWD/$b/expert_server/moe-expert-server" "$BIN/moe-expert-server"
fi
for f in moe_layer moe-expert-server; do
  [[ -x $BIN/$f ]] || { echo "bench_record: no $BIN/$f (build first, or set BIN)" >&2; exit 2; }
done
mkdir -p "$OUT"
sets=("$@")
[[ ${#sets[@]} -gt 0 ]] || sets=(olmoe mixtral kimi qwen3-decode qwen3-prompt deepseek)
modes=ours,ours-graph,ours-cpu,lru-copy,copy-all
# Decode on a trace: 8 untimed steps first (the cache, the rates and the copy
# outcomes settle, as in a worker that has run a while), then 12 timed.
trace_steps="--warmup=8 --steps=12"
failed=0

# run NAME PRESET DEFAULT_LAYERS DEFAULT_BATCHES DEFAULT_CACHE [moe_layer flags...]
run() {
  local name=$1 preset=$2 layers=$3 batches=$4 cache=$5; shift 5
  local key; key=$(tr 'a-z-' 'A-Z_' <<< "$name")
  local l=${key}_LAYERS b=${key}_BATCHES c=${key}_CACHE
  layers=${!l:-$layers} batches=${!b:-$batches} cache=${!c:-$cache}
  local args=(--preset="$preset" --layers="$layers" --batches="$batches" --cache="$cache" --runs="$RUNS"
              --weight-dtype="$DTYPE" --server-bin="$BIN/moe-expert-server" "$@")
  echo "## $name ($DTYPE): moe_layer ${args[*]}" | tee -a "$OUT/record.md"
  local t0=$SECONDS
  timeout "${RUN_TIMEOUT:-1200}" "$BIN/moe_layer" "${args[@]}" >> "$OUT/record.md" 2>> "$OUT/record.log"
  local rc=$?
  echo "$name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/record.md"
  [[ $rc -eq 0 ]] || failed=1
}

for set in "${sets[@]}"; do
  case $set in
    olmoe) run olmoe olmoe-1b-7b 0 1,8,32 25,50 --modes=$modes $trace_steps --trace="$TRACES/olmoe-1b-7b-decode.jsonl.xz" ;;
    mixtral) run mixtral mixtral-8x7b 0 1,8,32 25,50 --modes=$modes $trace_steps --trace="$TRACES/mixtral-8x7b-humaneval.jsonl.xz" ;;
    kimi) run kimi kimi-linear-48b 0 1,8,32 25,50 --modes=$modes $trace_steps --trace="$TRACES/kimi-linear-48b-decode.jsonl.xz" ;;
    qwen3-decode) run qwen3-decode qwen3-30b-a3b 48 1,8 25 --modes=ceiling,$modes ;;
    qwen3-prompt) run qwen3-prompt qwen3-30b-a3b 48 512,2048,8192 0,25 --zipf=0 --chunk=2048 --steps=2 --warmup=1 \
                    --modes=ours,ours-cpu,lru-copy,copy-all ;;
    deepseek) run deepseek deepseek-v3 4 1,8,512,2048 25 --zipf=0 --steps=3 --warmup=1 --modes=ceiling,$modes ;;
    llama)
      peer=${PEER:-../shared/peers/llama/peer.sh} join=${JOIN:-bench/peer_join.py}
      py=${PYTHON:-/opt/torch/.venv/bin/python3}; [[ -x $py ]] || py=python3
      case $DTYPE in bf16) ptype=bf16 ;; int8) ptype=q8_0 ;;
        *) echo "bench_record: llama: no peer format for DTYPE=$DTYPE (bf16, int8)" >&2; failed=1; continue ;; esac
      [[ -f $peer && -f $join ]] || { echo "bench_record: llama: no $peer or $join" >&2; failed=1; continue; }
      layers=${LLAMA_LAYERS:-16}
      run llama-decode qwen3-30b-a3b "$layers" 1,8,32 0,25 --zipf=0 --modes=ours,ours-graph,ours-cpu
      run llama-prompt qwen3-30b-a3b "$layers" 512,2048 0,25 --zipf=0 --steps=2 --warmup=1 --modes=ours,ours-cpu
      OUT=$OUT timeout "${RUN_TIMEOUT:-1200}" bash "$peer" "$layers" "$ptype" > /dev/null 2>> "$OUT/record.log"
      if [[ -s $OUT/llama_peer.md ]]; then
        mv "$OUT/llama_peer.md" "$OUT/llama_peer_$ptype.md"
        for sec in llama-decode llama-prompt; do
          for mode in ours ours-graph; do
            [[ $sec == llama-prompt && $mode == ours-graph ]] && continue
            { echo "## $sec beside llama.cpp ($ptype, $layers layers, same call): $mode"
              "$py" "$join" "$OUT/record.md" "$OUT/llama_peer_$ptype.md" --section="$sec ($DTYPE)" --mode=$mode \
                2>> "$OUT/record.log" || failed=1; } > "$OUT/join.md"
            cat "$OUT/join.md" >> "$OUT/record.md"; cat "$OUT/join.md" >> "$OUT/peer_join.md"
          done
        done
        cat "$OUT/llama_peer_$ptype.md"
      else
        echo "bench_record: the llama.cpp peer printed nothing (see $OUT/record.log)" | tee -a "$OUT/record.md"; failed=1
      fi ;;
    *) echo "bench_record: unknown set '$set' (olmoe mixtral kimi qwen3-decode qwen3-prompt deepseek llama)" >&2; exit 2 ;;
  esac
done
# The headline: each run's line, its exit, and its summary rows (ours beside its simpler modes).
awk -F'|' '/^## / || / rc=/ || (NF == 8 && $2 ~ /^ [0-9]+ $/)' "$OUT/record.md"
[[ -f $OUT/peer_join.md ]] && cat "$OUT/peer_join.md"
exit $failed
