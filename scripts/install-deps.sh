#!/usr/bin/env bash
# Installs the Debian packages the build needs, only those missing (idempotent,
# silent when everything is there). Debian 12 (bookworm); run as root.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libdnnl-dev ocl-icd-opencl-dev libhwloc-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev openssl xz-utils git ca-certificates
  clang libclang-rt-14-dev
  python3 python3-numpy python3-pip python3-torch  # the Python package's tests (tests/python; CPU torch for MoeLayer) and `pip install ./python`
)
# ocl-icd-opencl-dev: Debian's libdnnl-dev only *recommends* it, but its CMake
# config (dnnl-config.cmake) calls find_package(OpenCL) and fails without it.
# clang + libclang-rt-14-dev: the libFuzzer target (tests/shm_fuzz_main.cc).
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
echo "installing: ${missing[*]}"
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "installed ${#missing[@]} package(s)"
