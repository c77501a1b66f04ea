#!/usr/bin/env bash
# Bundles the built binaries with their shared libraries into .bundle/dev.tar.xz
# (git-ignored) for scripts/device_check.sh on the GPU + AMX host.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${BUILD_DIR:-build}
rm -rf .bundle/dev .bundle/dev.tar.xz
strip_dir=$(mktemp -d)
for f in cpu_expert_server/moe-expert-server core/moe-make-model client/moe-expert-demo bench/expert_kernels \
         bench/transport tests/kernel_test tests/expert_server_test tests/core_test tests/safetensors_test \
         tests/transport_test tests/shm_segment_test; do
  cp "$b/$f" "$strip_dir/" && strip "$strip_dir/$(basename "$f")"
done
../shared/tools/device-bundle.sh --xz .bundle/dev "$strip_dir"/*
rm -rf "$strip_dir" .bundle/dev
