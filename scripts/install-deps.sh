#!/usr/bin/env bash
# Installs the Debian packages the build needs, only those missing (idempotent,
# silent when everything is there). Debian 12 (bookworm); run as root.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libdnnl-dev ocl-icd-opencl-dev libhwloc-dev liblzma-dev nlohmann-json3-dev
  libcli11-dev
  libgtest-dev libgmock-dev openssl xz-utils git ca-certificates
)
# ocl-icd-opencl-dev: Debian's libdnnl-dev only *recommends* it, but its CMake
# config (dnnl-config.cmake) calls find_package(OpenCL) and fails without it.
# Test-only tools, left out when MOE_SKIP_TEST_DEPS=1 (the container image's
# build stage, which builds no tests):
# clang + libclang-rt-14-dev: the libFuzzer target (tests/shm_fuzz_main.cc);
# python3 + numpy + pip + CPU torch: the Python package's tests (tests/python,
# MoeLayer on CPU torch) and `pip install ./python`; python3-yaml and helm
# (scripts/fetch-helm.sh, pinned and checksummed): the Helm chart's check;
# iproute2 (`ip`): the veth links of tests/netns_test.cc.
if [[ "${MOE_SKIP_TEST_DEPS:-0}" != 1 ]]; then
  packages+=(clang libclang-rt-14-dev python3 python3-numpy python3-pip python3-torch python3-yaml iproute2)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
fetch_helm() {
  [[ "${MOE_SKIP_TEST_DEPS:-0}" == 1 ]] || "$(dirname "$0")/fetch-helm.sh"
}
if [[ ${#missing[@]} -eq 0 ]]; then fetch_helm; exit 0; fi
echo "installing: ${missing[*]}"
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "installed ${#missing[@]} package(s)"
fetch_helm
