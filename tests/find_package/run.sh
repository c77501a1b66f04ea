#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, then configures, builds and
# runs a stand-alone project that uses find_package(moe_expert_service).
set -euo pipefail
build=$1 src=$2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
cmake -S "$src/tests/find_package" -B "$scratch/build" -DCMAKE_PREFIX_PATH="$scratch/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$scratch/build" -j2 >/dev/null
"$scratch/build/engine_consumer"
"$scratch/build/c_consumer"
