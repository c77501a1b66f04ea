#!/usr/bin/env bash
# Builds if needed, then runs every test through ctest. Tests that need an ISA
# (AMX, AVX-512-BF16) or a GPU this machine lacks are reported as skipped, by name.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
build=${BUILD_DIR:-build}
cd "$build"
# One test at a time by default: several tests time deadlines and spin-waits,
# which two at once on a 2-core CI machine would only make noisy.
ctest --output-on-failure -j "${TEST_JOBS:-1}" --timeout 600 "$@"
