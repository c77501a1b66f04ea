#!/usr/bin/env bash
# Fresh-machine check: proves that the README's two Quick start commands work on
# a pristine Debian 12 with nothing installed by hand.
#
#   scripts/fresh-check.sh [--keep]        (as root; ~25 min on 2 cores)
#
# 1. builds a pristine bookworm root filesystem with Debian's mmdebstrap
#    (--variant=apt: essential packages + apt, from Debian's mirrors only) and
#    keeps its tarball (base.tar) for scripts/container-check.sh;
# 2. puts a clean clone of this repository's HEAD (committed work only) and a
#    copy of ../shared into it;
# 3. runs `./scripts/demo.sh` and then `./scripts/test.sh` inside it with
#    chroot (/proc, /dev and /sys bound; unmounted on every exit path);
# 4. fails if either command fails or if ctest's summary line is missing.
# Logs: $FRESH_DIR/{mmdebstrap,demo,test}.log (FRESH_DIR defaults to
# /var/tmp/moe-fresh). --keep leaves the root filesystem for inspection.
# Each phase prints its duration.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
keep=0
[[ "${1:-}" == "--keep" ]] && keep=1
[[ $(id -u) -eq 0 ]] || { echo "fresh-check: must run as root (mmdebstrap, chroot, mount)" >&2; exit 2; }
work=${FRESH_DIR:-/var/tmp/moe-fresh}
suite=${FRESH_SUITE:-bookworm}
mirror=${FRESH_MIRROR:-http://deb.debian.org/debian}
root=$work/root
shared=$(cd .. && pwd)/shared
[[ -d $shared ]] || { echo "fresh-check: $shared not found (the project's shared/ folder)" >&2; exit 2; }

phase_start=0
phase() { phase_start=$SECONDS; echo "== fresh-check: $1"; }
phase_done() { echo "== fresh-check: $1 took $(( (SECONDS - phase_start) / 60 )) min $(( (SECONDS - phase_start) % 60 )) s"; }

unmount_all() {
  # Deepest first; lazy as a last resort so that no exit path leaves mounts.
  local m
  for m in $(findmnt -rn -o TARGET | grep -E "^$root(/|$)" | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
}
cleanup() {
  local rc=$?
  unmount_all
  if findmnt -rn -o TARGET | grep -qE "^$root(/|$)"; then
    echo "fresh-check: mounts remain under $root; not deleting it" >&2
  elif [[ $keep -eq 0 && -d $root ]]; then
    rm -rf --one-file-system "$root"
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- 1. the pristine root filesystem
if ! command -v mmdebstrap >/dev/null; then
  phase "installing mmdebstrap on this host"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  phase_done "installing mmdebstrap"
fi
unmount_all
rm -rf --one-file-system "$root"
mkdir -p "$work"
phase "mmdebstrap --variant=apt $suite (pristine root filesystem)"
mmdebstrap --variant=apt --quiet "$suite" "$work/base.tar" "$mirror" > "$work/mmdebstrap.log" 2>&1 \
  || { tail -20 "$work/mmdebstrap.log"; echo "fresh-check: mmdebstrap failed" >&2; exit 1; }
mkdir -p "$root"
tar -xf "$work/base.tar" -C "$root"
phase_done "pristine root filesystem ($(du -sh "$work/base.tar" | cut -f1) tarball)"

# ---- 2. a clean clone of the project, and shared/
phase "clean clone of $(git rev-parse --short HEAD) + ../shared"
git clone -q --no-hardlinks "$repo" "$root/root/moe-expert-service"
cp -a "$shared" "$root/root/shared"
cp /etc/resolv.conf "$root/etc/resolv.conf"   # name resolution for apt inside the chroot
# Every installed Debian machine has an /etc/hosts naming localhost (the
# installer writes it; container runtimes inject one); mmdebstrap's tarball
# has none, and without it "localhost" goes to DNS.
[[ -f $root/etc/hosts ]] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' > "$root/etc/hosts"
phase_done "clone"

# ---- 3. the README's two commands, inside the chroot
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev"
mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys"   # hwloc reads the topology there
in_root() {
  chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    JOBS="${JOBS:-$(nproc)}" \
    bash -c "cd /root/moe-expert-service && $1"
}
phase "./scripts/demo.sh (inside the pristine root)"
set +e
in_root "./scripts/demo.sh" 2>&1 | tr '\r' '\n' | grep -v '^  step' | tee "$work/demo.log" | tail -25
demo_rc=${PIPESTATUS[0]}
set -e
phase_done "demo.sh (exit $demo_rc)"
[[ $demo_rc -eq 0 ]] || { echo "fresh-check: FAILED: ./scripts/demo.sh exited $demo_rc (log: $work/demo.log)" >&2; exit 1; }

phase "./scripts/test.sh (inside the pristine root)"
test_rc=0
in_root "./scripts/test.sh" > "$work/test.log" 2>&1 || test_rc=$?
phase_done "test.sh (exit $test_rc)"
grep -E "tests passed|The following tests|Not Run|\*\*\*Skipped|Failed" "$work/test.log" | tail -40
# A failing test's own words (gtest's "file:line: Failure" and what followed),
# so a CI log shows why, not only which.
grep -E -A8 ': Failure$|^\[  FAILED  \]' "$work/test.log" | head -120 || true
summary=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests failed out of [0-9]+' "$work/test.log" || true)
[[ $test_rc -eq 0 ]] || { echo "fresh-check: FAILED: ./scripts/test.sh exited $test_rc (log: $work/test.log)" >&2; exit 1; }
[[ -n $summary ]] || { echo "fresh-check: FAILED: ctest's summary line is missing from $work/test.log" >&2; exit 1; }
echo "fresh-check: OK on a pristine $suite: demo.sh exit 0; $summary"
