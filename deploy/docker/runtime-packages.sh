#!/usr/bin/env bash
# Prints the Debian/Ubuntu packages that own the shared libraries the given
# binaries load (ldd, each library resolved to its package with dpkg-query -S),
# one per line, sorted. The Dockerfile's build stage runs it on the four
# binaries so that the runtime stage installs exactly those packages, on
# Debian 12 and on the Ubuntu-based nvidia/cuda images alike (the names
# differ: libgrpc++1.51 there, libgrpc++1.51t64 on Ubuntu 24.04). Fails when a
# library is not found or belongs to no package.
# Usage: runtime-packages.sh BINARY...
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: $0 BINARY..." >&2; exit 2; }

# dpkg knows a file by the path its package shipped it under, which on a
# merged-/usr system may be /lib/... or /usr/lib/...: try the path ldd printed,
# the canonical path, and both with and without the /usr prefix.
owner() {
  local lib=$1 real p out
  real=$(readlink -f "$lib")
  for p in "$lib" "$real" "${lib#/usr}" "/usr$lib" "${real#/usr}" "/usr$real"; do
    if out=$(dpkg-query -S "$p" 2>/dev/null); then
      # "pkg:amd64: /path" or "pkg1, pkg2: /path": keep the names, drop the arch.
      grep -v '^diversion ' <<<"$out" | head -n1 | sed -e 's/: \/.*//' -e 's/:[a-z0-9_]*//g' -e 's/, /\n/g'
      return 0
    fi
  done
  return 1
}

failed=0
declare -A libs=()
for bin in "$@"; do
  deps=$(ldd "$bin") || { echo "runtime-packages: ldd $bin failed" >&2; exit 1; }
  if grep -q 'not found' <<<"$deps"; then
    echo "runtime-packages: $bin: $(grep 'not found' <<<"$deps" | tr -s ' \t\n' ' ')" >&2
    failed=1
  fi
  while read -r lib; do libs[$lib]=1; done < <(awk '$2 == "=>" && $3 ~ /^\// {print $3}' <<<"$deps")
done
packages=()
for lib in "${!libs[@]}"; do
  if pkgs=$(owner "$lib"); then
    mapfile -t -O "${#packages[@]}" packages <<<"$pkgs"
  else
    echo "runtime-packages: $lib belongs to no package" >&2
    failed=1
  fi
done
[[ $failed -eq 0 ]] || exit 1
printf '%s\n' "${packages[@]}" | sort -u
