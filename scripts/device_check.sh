#!/usr/bin/env bash
# Runs on the GPU + AMX host: builds nothing. Unpacks the bundle made here by
# scripts/device_bundle.sh and runs the phases named on the command line,
# writing logs and tables to $OUT:
#   tests                 every bundled test binary (cuda cases included; TESTS="a b" picks some)
#   moe_layer PRESET ARGS bench/moe_layer with those flags (e.g. moe_layer qwen3-30b-a3b --layers 24)
#   transport, kernels    the transport and expert-kernel benchmarks
#   latency                issue 14's set: transport, then moe_layer qwen3-30b-a3b (16 layers) at T=1 with every
#                         expert on the CPU (--zipf=0, cache 0%) and all on the GPU (cache 100%), and T=1,8 at
#                         25% cache (Zipf), 3 runs each (median [min-max])
#   quant                 issue 12 point 6 (~2-4 min): expert_kernels --formats=bf16,int8,int4 on the qwen3-30b-a3b
#                         shape (short timing: 0.2 s per case), then moe_layer qwen3-30b-a3b (16 layers, T=1,8,
#                         cache 0,25%, 3 runs, ours) with the server storing bf16, int8, then int4 experts
#   gpu_quant ARGS        bench/gpu_experts ARGS: the cuda backend's hit experts at bf16 / int8 / int4 cache
#                         formats, 1-128 rows per expert (DeepSeek-V3 and Qwen3-30B-A3B experts, 32 per call)
#                         vs HBM and cuBLAS's GEMM rate, one call and back to back (the kernels' GPU time), then
#                         GPU<->host row transfers (takes the rest of the line)
#   planner_decode        issue 21: moe_layer qwen3-30b-a3b (16 layers, bf16) decode T=1,8,32 at 25% cache, 3 runs,
#                         ours vs ours-cpu vs copy-all vs the floor
#   planner_prompt DTYPE  issue 21: moe_layer qwen3-30b-a3b (16 layers, --weight-dtype DTYPE) prompts of 512 and
#                         2048 tokens, uniform routing (--zipf=0), cache 0 and 25%, 3 runs, then the llama.cpp peer
#                         (bf16 -> bf16, int8 -> q8_0) in the same call; the peer folder is carried as .peer/llama
#   prefetch_ab DTYPE     issue 21: moe_layer deepseek-v3 (4 layers) 2048-token prompts, cache 0 and 25%, 2 runs, ours
#                         with the prompt prefetch's buffers per parity at the default (1 GiB: 24 int8 experts),
#                         6 (the 256 MiB of stop 24) and 48 (--prefetch-buffers), each table's copy-model line
#                         (the prefetch window)
#   planner_long DTYPE    issue 21's other prompt rows: moe_layer qwen3-30b-a3b (16 layers) at 8192 tokens in chunks
#                         of 2048 (--chunk), and deepseek-v3 (4 layers) prompts of 512 and 2048 tokens, cache 0
#                         and 25%, 3 runs each, --weight-dtype DTYPE (bf16, int8, int4), --rates-out to $OUT
#   graph_decode          issue 22: moe_layer qwen3-30b-a3b (16 layers, bf16) T=1,8 at 0 and 25% cache, 3 runs:
#                         ours (eager: the device path) vs ours-host (eager on the host path) vs ours-graph
#                         (device-planned calls replayed from CUDA graphs), each against its floor
#   python ARGS           the C ABI test, the Python package's tests (torch CUDA included),
#                         bench/python_overhead.py and python/examples/transformers_offload.py ARGS
#                         with ${PYTHON:-/opt/torch/.venv/bin/python3}
#   sliced                issue 26: moe_layer qwen3-30b-a3b (LAYERS=16 layers, bf16, every miss on the CPU:
#                         ours-cpu, cache 0%) T=1,8,32 and a 512-token prompt, one server of THREADS=16 threads vs
#                         --slices 2 (two servers of 8 threads on disjoint cores, each holding half of every
#                         expert), 3 runs
#   tp_bench              issue 26: moe_layer qwen3-30b-a3b (LAYERS=16 layers, bf16, Zipf routing) --tp 2: one
#                         cache over two GPUs (ncclAllReduce) vs a cache per GPU, T=1,8,32,2048, 25% per GPU, 3 runs
#   pool_clients          issue 45 point 1 on the CPU: bench/pool_clients (1, 2, 4 lockstep decode clients of one
#                         server, merging on / off; routing same, zipf, disjoint at T=1, zipf at T=8)
#   pool_soak             issue 45 point 4: bench/pool_soak, WORKERS (8) worker processes on the GPU and 2 expert
#                         servers, closed-loop decode for SOAK_SECONDS (240), RSS sampled (PLACEMENT per-worker|union)
#   remote                issue 45 point 4, what a remote pool costs: moe_layer qwen3-30b-a3b (LAYERS: 16 48) with
#                         its servers in network namespaces (veth pairs; LINKS shm,netns,netns:25,netns:100): decode
#                         T=1 at 25% cache, and a 2048-token prompt through two sliced servers without a cache
#   pool2                 issue 45 point 1 (two GPUs): one GPU alone, then moe_layer --tp 2 and --ep 2 with the
#                         server merging concurrent requests and without (LAYERS=8, BATCHES=1,8, RUNS=3)
#   ep_bench              issue 26: the same --ep 2: each GPU its own T tokens, one cache over both GPUs with
#                         the tokens exchanged over NCCL (ExpertParallel) vs a cache per GPU, T=1,8,32,512,2048
#   record [SETS]         the benchmark of record: scripts/bench_record.sh (recorded routing at each trace's
#                         geometry, 48-layer Qwen3-30B-A3B, DeepSeek-V3) to $OUT/record.md; env as that script's
#   hf_full MODEL LAYERS  bench/hf_full_depth.py: a whole model (qwen3: Qwen3-30B-A3B geometry, bf16; deepseek:
#                         DeepSeek-V3 geometry with Kimi-K2-format int4 experts) saved on this host and loaded through
#                         transformers' experts backend: correctness, decode/prompt tokens/s, memory, transformers'
#                         offload (HF_ARGS: more flags; HF_WORK: checkpoint directory, removed after)
#   gptoss LAYERS         issue 46: GPT-OSS-120B (LAYERS of its 36 layers, MXFP4 experts) beside llama.cpp on one
#                         file: gptoss_make, gptoss_llama, gptoss_ours in turn (36 layers take more than one call's
#                         600 s: run the sub-phases in separate calls, on the same warm machine)
#   gptoss_make LAYERS    bench/make_peer_gguf.py writes the whole model (llama.cpp's gpt-oss layout, ~1.75 GB per
#                         layer) into GPTOSS_WORK (default /tmp/gptoss_work, kept between calls: skipped when made;
#                         a model of other LAYERS is removed first, the disk holds one)
#   gptoss_llama LAYERS   llama.cpp on it, experts on the CPU (-ngl 99 -ot exps=CPU -t 16) (GPTOSS_LLAMA: the parts, default
#                         "decode prompt batched"): llama-bench decode
#                         (tg32, 3 runs) and a 2048-token prompt, llama-batched-bench 1 and 8 sequences, to
#                         $OUT/gptoss_llama.md
#   gptoss_ours LAYERS    gptoss_decode then gptoss_prompt: bench/moe_layer --model on the same file (--weight-dtype
#                         mxfp4), decode T=1,8 at cache GPTOSS_CACHE (default 0,7: 7% of a bf16 cache's memory, 27%
#                         of the MXFP4 experts) (ours, ours-graph, ours-cpu) / one 2048-token
#                         prompt (--zipf=0, ours and ours-cpu), to $OUT/gptoss_ours.md
#   tp ARGS               issue 26: python/examples/transformers_tp.py ARGS on every GPU of the machine (needs 2):
#                         one cache across the GPUs (tensor parallel, torch all-reduce) vs a cache per GPU
#   Python from the working tree instead of the bundle: PYDIR=python PYTESTDIR=tests/python
#   HF_SCRIPT=bench/hf_full_depth.py
#   usage (on the host): bash scripts/device_check.sh tests moe_layer qwen3-30b-a3b --layers 8
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
B=/tmp/moe-bundle
sum=$(md5sum .bundle/dev.tar.xz | cut -d' ' -f1)
if [[ ! -d $B/bin || "$(cat "$B/.sum" 2>/dev/null)" != "$sum" ]]; then
  rm -rf "$B" && mkdir -p "$B" && tar -xJf .bundle/dev.tar.xz -C "$B" --strip-components=1 && echo "$sum" > "$B/.sum"
fi
export LD_LIBRARY_PATH=$B/lib MOE_BIN_DIR=$B/bin
command -v ip > /dev/null || [[ ! -x $B/bin/ip ]] || export PATH=$PATH:$B/bin  # the bundle's iproute2 (netns links)
{
  echo "## machine"; date -u; uname -r
  lscpu | grep -E 'Model name|^CPU\(s\)|NUMA node\(s\)|L3'
  grep -o -E 'amx[a-z_0-9]*|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  free -g | head -2
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
} > "$OUT/machine.txt" 2>&1

# The GPT-OSS peer model of $1 layers (bench/make_peer_gguf.py), made once in GPTOSS_WORK with llama.cpp's
# binaries beside it; prints its path, or returns 1 with the reason on stderr.
gptoss_model() {
  local layers=$1 W=${GPTOSS_WORK:-/tmp/gptoss_work}
  local M=$W/gpt-oss-120b-${layers}L-mxfp4.gguf py=${PYTHON:-/opt/torch/.venv/bin/python3}
  [[ -x $py ]] || py=python3
  mkdir -p "$W"
  [[ -x $W/llama/bin/llama-bench ]] || { mkdir -p "$W/llama" && tar -xJf "$B/peer/llama/llama-bin.tar.xz" -C "$W/llama"; }
  if [[ ! -s $M.ok ]]; then
    rm -f "$W"/*.gguf "$W"/*.gguf.ok  # the disk holds one 36-layer model
    df -h "$W" | tail -1 >&2
    timeout 570 "$py" "$B/make_peer_gguf.py" "$M" --preset gpt-oss-120b --layers "$layers" --gguf-py "$B/peer/llama/gguf-py" \
      --vocab "$W/llama/share/ggml-vocab-qwen2.gguf" > "$OUT/gptoss_make.log" 2>&1 && echo ok > "$M.ok"
    tail -2 "$OUT/gptoss_make.log" >&2
    [[ -s $M.ok ]] || { rm -f "$M"; echo "gptoss: the model was not written ($OUT/gptoss_make.log)" >&2; return 1; }
  fi
  echo "$M"
}

while [[ $# -gt 0 ]]; do
  phase=$1; shift
  case $phase in
    tests)
      echo "## tests" | tee -a "$OUT/tests.txt"
      for t in ${TESTS:-device_backend_test graph_capture_test attention_test dispatcher_test worker_test system_test coordinator_process_test expert_cache_test kernel_test core_test expert_server_test shm_segment_test transport_test cost_model_test hardening_test miss_plan_test step_floor_test quantization_test grpc_wire_test shared_host_copy_test sliced_experts_test tensor_parallel_test nccl_group_test model_identity_test cache_replay_test coordinator_test metrics_test}; do
        [[ -x $B/bin/$t ]] || continue
        timeout 300 "$B/bin/$t" > "/tmp/$t.log" 2>&1
        rc=$?
        echo "$t: rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "/tmp/$t.log" | tr '\n' ' ')" | tee -a "$OUT/tests.txt"
        [[ $rc -ne 0 ]] && grep -E "Failure|Expected|Which|FAILED|error|rror:" "/tmp/$t.log" | grep -v " I server\]" | head -40 >> "$OUT/tests.txt"
      done ;;
    moe_layer)
      preset=$1; shift
      args=()
      while [[ $# -gt 0 && $1 == --* ]]; do args+=("$1"); shift; done  # flags as --name=value
      echo "## moe_layer $preset ${args[*]}" | tee -a "$OUT/moe_layer.md"
      timeout 580 "$B/bin/moe_layer" --preset "$preset" "${args[@]}" >> "$OUT/moe_layer.md" 2>> "$OUT/moe_layer.log"
      echo "moe_layer rc=$?" | tee -a "$OUT/moe_layer.md"
      tail -30 "$OUT/moe_layer.md" ;;
    record)
      # The benchmark of record (scripts/bench_record.sh) over the sets named after it (default: all).
      BIN=$B/bin TRACES=$B/traces PEER=$B/peer/llama/peer.sh JOIN=$B/peer_join.py OUT=$OUT \
        bash "$B/bench_record.sh" "$@"; echo "record rc=$?"; shift $# ;;
    demo)
      echo "## demo (cuda worker)" | tee -a "$OUT/demo.txt"
      timeout 300 "$B/bin/moe-demo" --bin-dir "$B/bin" "$@" 2>&1 | tr '\r' '\n' | grep -v "^  step" >> "$OUT/demo.txt"
      echo "demo rc=${PIPESTATUS[0]}" | tee -a "$OUT/demo.txt"; tail -40 "$OUT/demo.txt"; shift $# ;;
    transport)
      timeout 300 "$B/bin/transport" > "$OUT/transport.md" 2>> "$OUT/logs.txt"; echo "transport rc=$?"; cat "$OUT/transport.md" ;;
    latency)
      bash "$0" transport \
        moe_layer qwen3-30b-a3b --layers=16 --batches=1 --cache=0,100 --zipf=0 --runs=3 --modes=ceiling,ours,ours-cpu \
        moe_layer qwen3-30b-a3b --layers=16 --batches=1,8 --cache=25 --runs=3 --modes=ceiling,ours,ours-cpu ;;
    kernels)
      timeout 420 "$B/bin/expert_kernels" > "$OUT/expert_kernels.md" 2>> "$OUT/logs.txt"; echo "kernels rc=$?"; cat "$OUT/expert_kernels.md" ;;
    quant)
      timeout 240 "$B/bin/expert_kernels" --formats=bf16,int8,int4 --shapes=qwen3-30b-a3b --tokens=1,16,64,256,1024 \
        --min-seconds=0.2 --bw-gib=2 > "$OUT/expert_kernels_quant.md" 2>> "$OUT/logs.txt"
      echo "kernels quant rc=$?"; cat "$OUT/expert_kernels_quant.md"
      bash "$0" \
        moe_layer qwen3-30b-a3b --layers=16 --batches=1,8 --cache=0,25 --runs=3 --modes=ours --weight-dtype=bf16 \
        moe_layer qwen3-30b-a3b --layers=16 --batches=1,8 --cache=0,25 --runs=3 --modes=ours --weight-dtype=int8 \
        moe_layer qwen3-30b-a3b --layers=16 --batches=1,8 --cache=0,25 --runs=3 --modes=ours --weight-dtype=int4 ;;
    gpu_quant)
      # issue 23 point 2: the cuda backend's hit experts per cache format (bench/gpu_experts), ARGS optional
      timeout 540 "$B/bin/gpu_experts" "$@" 2>&1 | tee -a "$OUT/gpu_quant.txt"
      set -- ;;
    planner_decode)
      bash "$0" moe_layer qwen3-30b-a3b --layers=16 --batches=1,8,32 --cache=25 --runs=3 \
        --modes=ceiling,ours,ours-cpu,copy-all ;;
    planner_prompt)
      dtype=$1; shift
      bash "$0" moe_layer qwen3-30b-a3b --layers=16 --batches=512,2048 --cache=0,25 --zipf=0 --runs=3 --steps=3 \
        --warmup=1 --modes=ceiling,ours,ours-cpu,copy-all --weight-dtype="$dtype"
      peer=.peer/llama/peer.sh
      if [[ -f $peer ]]; then
        OUT=$OUT timeout 300 bash "$peer" 16 "$([[ $dtype == int8 ]] && echo q8_0 || echo bf16)" > /dev/null 2>> "$OUT/logs.txt"
        mv "$OUT/llama_peer.md" "$OUT/llama_peer_$dtype.md" 2>/dev/null; cat "$OUT/llama_peer_$dtype.md"
      fi ;;
    prefetch_ab)
      dtype=$1; shift
      for pb in 0 6 48; do
        bash "$0" moe_layer deepseek-v3 --layers=4 --batches=2048 --cache=0,25 --zipf=0 --runs=2 --steps=2 --warmup=1 \
          --modes=ours --weight-dtype="$dtype" --prefetch-buffers=$pb
      done ;;
    planner_long)
      dtype=$1; shift
      bash "$0" moe_layer qwen3-30b-a3b --layers=16 --batches=8192 --chunk=2048 --cache=0,25 --zipf=0 --runs=3 \
        --steps=2 --warmup=1 --modes=ceiling,ours,ours-cpu,copy-all --weight-dtype="$dtype" \
        --rates-out="$OUT/rates_qwen3_$dtype.json"
      bash "$0" moe_layer deepseek-v3 --layers=4 --batches=512,2048 --cache=0,25 --zipf=0 --runs=3 --steps=3 \
        --warmup=1 --modes=ceiling,ours,ours-cpu,copy-all --weight-dtype="$dtype" \
        --rates-out="$OUT/rates_deepseek_$dtype.json" ;;
    graph_decode)
      bash "$0" moe_layer qwen3-30b-a3b --layers=16 --batches=1,8 --cache=0,25 --runs=3 \
        --modes=ceiling,ours,ours-host,ours-graph ;;
    sliced)
      for s in 1 2; do
        "$B/bin/moe_layer" --preset=qwen3-30b-a3b --layers=${LAYERS:-16} --batches=1,8,32,512 --cache=0 --zipf=0 \
          --modes=ours-cpu --runs=3 --slices=$s --server-threads=${THREADS:-16} --server-bin "$B/bin/moe-expert-server" \
          > "$OUT/sliced_$s.md" 2> "$OUT/sliced_$s.log"
        echo "sliced $s rc=$?"; grep -E "^\|" "$OUT/sliced_$s.md" | head -8
      done ;;
    tp_bench)
      "$B/bin/moe_layer" --preset=qwen3-30b-a3b --layers=${LAYERS:-16} --tp=2 --batches=1,8,32,2048 --cache=25 \
        --runs=3 --steps=5 --warmup=2 --server-bin "$B/bin/moe-expert-server" > "$OUT/tp_bench.md" 2> "$OUT/tp_bench.log"
      echo "tp_bench rc=$?"; grep -E "^\|" "$OUT/tp_bench.md"; tail -3 "$OUT/tp_bench.log" ;;
    pool_clients)
      # issue 45 point 1 without GPUs: bench/pool_clients, 1, 2 and 4 decode clients of one server in lockstep,
      # merging on and off, routing same / zipf / disjoint at T=1 and zipf at T=8, to $OUT/pool_clients.md
      for spec in ${POOL_SPECS:-same:1 zipf:1 disjoint:1 zipf:8}; do
        timeout 150 "$B/bin/pool_clients" --layers=${LAYERS:-8} --clients=1,2,4 --routing=${spec%:*} --tokens=${spec#*:} \
          --runs=${RUNS:-3} --server-bin "$B/bin/moe-expert-server" ${SERVER_FLAGS:+--server-flags="$SERVER_FLAGS"} \
          >> "$OUT/pool_clients.md" 2>> "$OUT/pool_clients.log"
        echo "pool_clients $spec rc=$?"
      done
      grep -E '^\||all runs' "$OUT/pool_clients.md" | grep -v -- '---' ;;
    pool_soak)
      # issue 45 point 4: WORKERS (8) moe-gpu-worker processes on one GPU (cuda) and 2 expert servers (SERVER_THREADS
      # each, 6), closed-loop decode of LAYERS (8) Qwen3-30B-A3B layers for SOAK_SECONDS (240), RSS sampled
      timeout $(( ${SOAK_SECONDS:-240} + 200 )) "$B/bin/pool_soak" --preset=qwen3-30b-a3b --layers=${LAYERS:-8} \
        --workers=${WORKERS:-8} --servers=2 --server-threads=${SERVER_THREADS:-6} --device=cuda \
        --seconds=${SOAK_SECONDS:-240} --sample-seconds=${SAMPLE_SECONDS:-20} --placement=${PLACEMENT:-per-worker} \
        --bin-dir "$B/bin" ${SERVER_FLAGS:+--server-flags="$SERVER_FLAGS"} \
        > "$OUT/pool_soak.md" 2> "$OUT/pool_soak.log"
      echo "pool_soak rc=$?"; grep -E '^\||^All|^###|^CPU' "$OUT/pool_soak.md" | grep -v -- '---' ;;
    remote)
      # issue 45 point 4: the same server processes over shm and over gRPC through veth pairs into their own network
      # namespaces, straight and behind a relay of 25 / 100 us each way; to $OUT/remote_<layers>_{decode,prompt}.md
      for L in ${LAYERS:-16 48}; do
        timeout ${REMOTE_TIMEOUT:-280} "$B/bin/moe_layer" --preset=qwen3-30b-a3b --layers=$L --batches=1 --cache=25 \
          --modes=${REMOTE_MODES:-ours} --runs=${RUNS:-3} --warmup=8 --steps=16 --links=${LINKS:-shm,netns,netns:25,netns:100} \
          --server-bin "$B/bin/moe-expert-server" > "$OUT/remote_${L}_decode.md" 2> "$OUT/remote_${L}_decode.log"
        echo "remote decode $L layers rc=$?"; grep -E '^\| 1 |^Links' "$OUT/remote_${L}_decode.md"
        timeout ${REMOTE_TIMEOUT:-280} "$B/bin/moe_layer" --preset=qwen3-30b-a3b --layers=$L --batches=2048 --chunk=2048 \
          --cache=0 --zipf=0 --slices=2 --modes=ours --runs=${RUNS:-3} --warmup=1 --steps=2 \
          --links=${PROMPT_LINKS:-shm,netns:25,netns:100} --server-bin "$B/bin/moe-expert-server" \
          > "$OUT/remote_${L}_prompt.md" 2> "$OUT/remote_${L}_prompt.log"
        echo "remote prompt $L layers rc=$?"; grep -E '^\| 2048 |^Links' "$OUT/remote_${L}_prompt.md"
      done ;;
    pool2)
      # issue 45 point 1: one server, two GPUs (LAYERS=8 of Qwen3-30B-A3B, bf16, Zipf, 25% cache per GPU, T=BATCHES
      # 1,8, RUNS=3): one GPU alone, then TP-2 and EP-2 with the server merging concurrent requests (its default)
      # and without (--merge-requests=false), to $OUT/pool2.md
      common=(--preset=qwen3-30b-a3b --layers=${LAYERS:-8} --batches=${BATCHES:-1,8} --cache=25 --runs=${RUNS:-3}
              --warmup=8 --steps=16 --server-bin "$B/bin/moe-expert-server")
      echo "## pool2 $(date -u +%FT%TZ): ${common[*]}" | tee -a "$OUT/pool2.md"
      for merge in true false; do
        echo "### one GPU alone, server --merge-requests=$merge" >> "$OUT/pool2.md"
        timeout 200 "$B/bin/moe_layer" "${common[@]}" --modes=ours --server-flags="--merge-requests=$merge" \
          >> "$OUT/pool2.md" 2> "$OUT/pool2_one_$merge.log"
        echo "one GPU merge=$merge rc=$?"
      done
      for par in ${POOL2_MODES:-tp ep}; do
        for merge in true false; do
          echo "### --$par=2, server --merge-requests=$merge" >> "$OUT/pool2.md"
          timeout 200 "$B/bin/moe_layer" "${common[@]}" --$par=2 --server-flags="--merge-requests=$merge" \
            >> "$OUT/pool2.md" 2> "$OUT/pool2_${par}_$merge.log"
          echo "$par merge=$merge rc=$?"; grep -E 'stopped;' "$OUT/pool2_${par}_$merge.log" | tail -1
        done
      done
      grep -E '^(#|\|)' "$OUT/pool2.md" | grep -v -- '---' | tail -40 ;;
    ep_bench)
      "$B/bin/moe_layer" --preset=qwen3-30b-a3b --layers=${LAYERS:-16} --ep=2 --batches=${BATCHES:-1,8,32,512,2048} \
        --cache=25 --runs=3 --steps=5 --warmup=2 ${SERVER_THREADS:+--server-threads=$SERVER_THREADS} \
        --server-bin "$B/bin/moe-expert-server" > "$OUT/ep_bench${SERVER_THREADS:+_$SERVER_THREADS}.md" \
        2> "$OUT/ep_bench${SERVER_THREADS:+_$SERVER_THREADS}.log"
      echo "ep_bench rc=$?"; grep -E "^\|" "$OUT/ep_bench${SERVER_THREADS:+_$SERVER_THREADS}.md" ;;
    gptoss)
      bash "$0" gptoss_make "$1" gptoss_llama "$1" gptoss_ours "$1"; shift ;;
    gptoss_make)
      M=$(gptoss_model "$1") && ls -l "$M"; shift ;;
    gptoss_llama)
      M=$(gptoss_model "$1") || { shift; continue; }
      LB=${GPTOSS_WORK:-/tmp/gptoss_work}/llama
      export LD_LIBRARY_PATH="$LB/lib:$LB/lib/fallback:$B/lib"
      cat "$M" > /dev/null  # page cache
      "$LB/bin/llama-bench" --list-devices 2>&1 | grep -q CUDA0 || echo "WARNING: llama.cpp's CUDA backend did not load"
      {
        echo "## llama.cpp, GPT-OSS-120B geometry, $1 layers, MXFP4 experts on the CPU (-ngl 99 -ot exps=CPU -t 16), $(date -u +%FT%TZ)"
        parts=" ${GPTOSS_LLAMA:-decode prompt batched} "
        if [[ $parts == *" decode "* ]]; then
          echo "### decode, 1 sequence"
          timeout 150 "$LB/bin/llama-bench" -m "$M" -ngl 99 -ot exps=CPU -t 16 -p 0 -n 32 -r 3 -lm none -o md 2>&1 | grep -E '^\|'
        fi
        if [[ $parts == *" prompt "* ]]; then
          echo "### 2048-token prompt"
          timeout 200 "$LB/bin/llama-bench" -m "$M" -ngl 99 -ot exps=CPU -t 16 -p 2048 -n 0 -ub 2048 -b 2048 -r 3 -lm none -o md 2>&1 | grep -E '^\|'
        fi
        if [[ $parts == *" batched "* ]]; then
          echo "### batched decode (llama-batched-bench: S_TG t/s is tokens/s over all sequences)"
          timeout 200 "$LB/bin/llama-batched-bench" -m "$M" -ngl 99 -ot exps=CPU -t 16 -lm none -c 4096 -b 2048 -ub 512 \
            -npp 128 -ntg 32 -npl 1,8 2>&1 | grep -E '^\|'
        fi
      } | tee -a "$OUT/gptoss_llama.md"
      export LD_LIBRARY_PATH=$B/lib; shift ;;
    gptoss_ours)
      bash "$0" gptoss_decode "$1" gptoss_prompt "$1"; shift ;;
    gptoss_decode|gptoss_prompt)
      M=$(gptoss_model "$1") || { shift; continue; }
      if [[ $phase == gptoss_decode ]]; then
        # --cache is a share of a bf16 cache's GPU memory: 7% holds 27% of the MXFP4 experts, 25% holds 94%
        rows=(--batches=1,8 --cache=${GPTOSS_CACHE:-0,7} --runs=${RUNS:-3} --modes=ours,ours-graph,ours-cpu)
      else
        rows=(--batches=2048 --zipf=0 --chunk=2048 --steps=2 --warmup=1 --cache=${GPTOSS_CACHE:-0,7} --runs=${RUNS:-3}
              --modes=${GPTOSS_PROMPT_MODES:-ours,ours-cpu})
      fi
      echo "## $phase: moe_layer --model $M (GPT-OSS-120B geometry, $1 layers) ${rows[*]}" | tee -a "$OUT/gptoss_ours.md"
      timeout 580 "$B/bin/moe_layer" --model="$M" --weight-dtype=mxfp4 "${rows[@]}" \
        >> "$OUT/gptoss_ours.md" 2>> "$OUT/gptoss_ours.log"
      echo "moe_layer rc=$?" | tee -a "$OUT/gptoss_ours.md"; grep -E '^\|' "$OUT/gptoss_ours.md" | tail -12; shift ;;
    tp)
      py=${PYTHON:-/opt/torch/.venv/bin/python3}
      MOE_LIBRARY=$B/bin/libmoe.so PYTHONPATH=$B/python timeout 580 "$py" "$B/python/examples/transformers_tp.py" \
        --server-bin "$B/bin/moe-expert-server" --gpus "$(nvidia-smi -L | wc -l)" --out "$OUT/transformers_tp.md" "$@" \
        > "$OUT/tp.txt" 2>&1
      echo "transformers_tp rc=$?" | tee -a "$OUT/tp.txt"
      grep -E "rc=|FAIL|Error|error|^\|" "$OUT/tp.txt" | tail -40; shift $# ;;
    python)
      py=${PYTHON:-/opt/torch/.venv/bin/python3}
      echo "## python ($py)" | tee -a "$OUT/python.txt"
      timeout 300 "$B/bin/c_api_test" >> "$OUT/python.txt" 2>&1; echo "c_api_test rc=$?" | tee -a "$OUT/python.txt"
      for t in ${PYTESTS:-test_session test_torch_layer test_expert_parallel test_hf_backend}; do
        MOE_LIBRARY=$B/bin/libmoe.so PYTHONPATH=${PYDIR:-$B/python} timeout 300 "$py" "${PYTESTDIR:-$B/python/tests}/$t.py" >> "$OUT/python.txt" 2>&1
        echo "$t rc=$?" | tee -a "$OUT/python.txt"
      done
      [[ -n ${PYTESTS:-} ]] && { grep -E "rc=|FAIL|Error|error:" "$OUT/python.txt" | tail -40; continue; }
      MOE_LIBRARY=$B/bin/libmoe.so PYTHONPATH=$B/python timeout 300 "$py" "$B/python/bench/python_overhead.py" \
        --server-bin "$B/bin/moe-expert-server" --preset qwen3-30b-a3b --layers 2 > "$OUT/python_overhead.md" 2>> "$OUT/python.txt"
      echo "python_overhead rc=$?" | tee -a "$OUT/python.txt"; cat "$OUT/python_overhead.md"
      MOE_LIBRARY=$B/bin/libmoe.so PYTHONPATH=$B/python timeout 580 "$py" "$B/python/examples/transformers_offload.py" \
        --server-bin "$B/bin/moe-expert-server" --out "$OUT/transformers_offload.md" "$@" >> "$OUT/python.txt" 2>&1
      echo "transformers_offload rc=$?" | tee -a "$OUT/python.txt"
      grep -E "rc=|FAIL|Error|error:|^\|" "$OUT/python.txt" | tail -40; shift $# ;;
    hf_full)
      # hf_full MODEL LAYERS: bench/hf_full_depth.py (a whole model through transformers' experts backend;
      # extra flags in HF_ARGS, checkpoint under HF_WORK)
      py=${PYTHON:-/opt/torch/.venv/bin/python3}; model=$1; layers=$2; shift 2
      df -h "${HF_WORK:-/tmp/hf_work}" 2>/dev/null | tail -1; mkdir -p "${HF_WORK:-/tmp/hf_work}"
      MOE_LIBRARY=$B/bin/libmoe.so PYTHONPATH=${PYDIR:-$B/python} timeout ${HF_TIMEOUT:-590} "$py" "${HF_SCRIPT:-$B/python/bench/hf_full_depth.py}" \
        --model "$model" --layers "$layers" --server-bin "$B/bin/moe-expert-server" --workdir "${HF_WORK:-/tmp/hf_work}" \
        --out "$OUT/hf_full_depth.md" ${HF_ARGS:-} > "$OUT/hf_full_depth_$model.log" 2>&1
      echo "hf_full_depth $model $layers rc=$?"; tail -5 "$OUT/hf_full_depth_$model.log"; rm -rf "${HF_WORK:-/tmp/hf_work}" ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
