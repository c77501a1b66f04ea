#!/usr/bin/env bash
# Builds if needed, then runs every test through ctest. Tests that need an ISA
# (AMX, AVX-512-BF16) or a GPU this machine lacks are reported as skipped, by name.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
build=${BUILD_DIR:-build}
cd "$build"
ctest --output-on-failure -j "${TEST_JOBS:-2}" --timeout 600 "$@"
