#!/usr/bin/env bash
# Installs missing packages, configures (Release, Ninja) and builds into
# ${BUILD_DIR:-build}. Incremental: a second run only rebuilds what changed.
# CUDA is used when /usr/local/cuda/bin/nvcc (or nvcc on PATH) exists.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$build" -j "$jobs"
