#!/usr/bin/env bash
# Installs missing packages, configures (Release, Ninja) and builds into
# ${BUILD_DIR:-build}. Incremental: a second run only rebuilds what changed.
# CUDA is used when /usr/local/cuda/bin/nvcc (or nvcc on PATH) exists.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
# ccache, when installed, makes a rebuild in a fresh clone on the same machine
# (e.g. CI) cheap; paths are hashed relative to the checkout.
launcher=()
if command -v ccache >/dev/null && [[ "${CMAKE_ARGS:-}" != *COMPILER_LAUNCHER* ]]; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=1
fi
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" ${CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$build" -j "$jobs"
