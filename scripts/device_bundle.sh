#!/usr/bin/env bash
# Bundles the built binaries with their shared libraries into .bundle/dev.tar.xz
# (git-ignored) for scripts/device_check.sh on the GPU + AMX host. Build first
# with CUDA (nvcc found; -DMOE_CUDA_ARCH=90): BUILD_DIR=build scripts/device_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
b=${BUILD_DIR:-build}
rm -rf .bundle/dev .bundle/dev.tar.xz .bundle/dev.tar.xz.part
strip_dir=$(mktemp -d)
default="expert_server/moe-expert-server gpu_worker/moe-gpu-worker model/moe-make-model demo/moe-expert-demo
  bench/expert_kernels bench/transport bench/moe_layer bench/gpu_experts bench/pool_clients bench/pool_soak
  tests/kernel_test tests/expert_server_test tests/core_test tests/transport_test tests/shm_segment_test
  tests/device_backend_test tests/attention_test tests/dispatcher_test tests/worker_test tests/expert_cache_test
  tests/cost_model_test tests/graph_capture_test c_api/libmoe.so tests/c_api_test
  coordinator/moe-coordinator client/moectl demo/moe-demo tests/system_test tests/hardening_test
  tests/coordinator_process_test tests/admission_policy_test tests/miss_plan_test tests/quantization_test
  tests/grpc_wire_test tests/shared_host_copy_test tests/sliced_experts_test tests/tensor_parallel_test
  tests/nccl_group_test tests/step_floor_test tests/model_identity_test tests/cache_replay_test tests/coordinator_test tests/metrics_test
  tests/gpt_oss_test tests/mxfp4_test"
for f in ${BINARIES:-$default}; do
  [[ -x "$b/$f" ]] || { echo "missing $b/$f (build it first)" >&2; exit 1; }
  cp "$b/$f" "$strip_dir/" && strip "$strip_dir/$(basename "$f")"
done
# iproute2's ip (with its libraries) for moe_layer --links netns where the host has none; device_check.sh puts
# it on PATH only then.
if [[ -x /usr/sbin/ip ]]; then mkdir -p "$strip_dir/iproute2" && cp /usr/sbin/ip "$strip_dir/iproute2/"; fi
../shared/tools/device-bundle.sh .bundle/dev "$strip_dir"/*
# The Python package, its tests and examples (the `python` phase of device_check.sh).
mkdir -p .bundle/dev/python
cp -r python/moe_expert_service python/examples python/_build python/pyproject.toml .bundle/dev/python/
cp -r tests/python .bundle/dev/python/tests
mkdir -p .bundle/dev/python/bench && cp bench/python_overhead.py bench/hf_full_depth.py .bundle/dev/python/bench/
find .bundle/dev/python -name __pycache__ -prune -exec rm -rf {} +
# The recorded routing traces (read where they lie, never kept in the repo) and
# the benchmark of record's script (the `record` phase of device_check.sh).
mkdir -p .bundle/dev/traces && cp ../shared/data/traces/*.jsonl.xz .bundle/dev/traces/
cp scripts/bench_record.sh bench/peer_join.py .bundle/dev/
# The llama.cpp peer (the record's `llama` set runs it in the same call) and the GPT-OSS peer model's writer
# (the `gptoss*` phases).
mkdir -p .bundle/dev/peer && cp -r ../shared/peers/llama .bundle/dev/peer/
cp bench/make_peer_gguf.py .bundle/dev/
# xz -9: its 64 MiB dictionary reaches the previous executable's copy of the
# same CUDA kernels (~9 MB in every GPU binary), which -6's 8 MiB does not:
# 59 MB of six GPU binaries compress to 5 MB instead of 20. One thread: xz's
# threads cut the input into blocks that do not see each other.
# Written aside and renamed when whole: a device call that carries the archive
# while it is being written would take a truncated one (it did: tar's
# "Unexpected EOF" on the host, half the binaries missing).
tar -C .bundle -cf - dev | xz -9 -T1 > .bundle/dev.tar.xz.part
mv .bundle/dev.tar.xz.part .bundle/dev.tar.xz
echo "archive: .bundle/dev.tar.xz ($(du -sh .bundle/dev.tar.xz | cut -f1))"
# The device tool carries at most 64 MiB (with shared/): past that, bundle a subset.
if (( $(stat -c %s .bundle/dev.tar.xz) > 60 * 1024 * 1024 )); then
  echo "warning: the archive is over 60 MiB, more than the device tool carries with shared/: pick the" \
       "executables a call needs with BINARIES=\"expert_server/moe-expert-server c_api/libmoe.so tests/...\"" >&2
fi
rm -rf "$strip_dir" .bundle/dev
