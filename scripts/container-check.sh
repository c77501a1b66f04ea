#!/usr/bin/env bash
# Container check: builds deploy/docker/Dockerfile for real and runs the image,
# with no registry pulls.
#
#   scripts/container-check.sh [BASE_TAR]      (as root; ~15 min on 2 cores)
#
# 1. imports a pristine Debian 12 root filesystem (BASE_TAR, default the one
#    scripts/fresh-check.sh left in $FRESH_DIR/base.tar; made with mmdebstrap
#    --variant=apt when absent) as the local image localhost/moe-debian12-base;
# 2. builds the Dockerfile from a clean clone of HEAD with Debian's buildah
#    (`buildah bud --isolation=chroot --pull=never`), BUILD_IMAGE and
#    RUNTIME_IMAGE both that local image (apt runs inside the build);
# 3. runs in the built image (`buildah from` + `buildah run --isolation=chroot`)
#    deploy/docker/smoke.sh: every binary's --help, then coordinator + expert
#    server + cpu worker on loopback answering ForwardLayer, checked against
#    the reference MoE.
# Container storage lives under $FRESH_DIR/containers and is removed at the
# end, so every run builds from nothing. Each phase prints its duration.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
[[ $(id -u) -eq 0 ]] || { echo "container-check: must run as root" >&2; exit 2; }
work=${FRESH_DIR:-/var/tmp/moe-fresh}
base_tar=${1:-$work/base.tar}
store=$work/containers
ctx=$work/context
phase_start=0
phase() { phase_start=$SECONDS; echo "== container-check: $1"; }
phase_done() { echo "== container-check: $1 took $(( (SECONDS - phase_start) / 60 )) min $(( (SECONDS - phase_start) % 60 )) s"; }

need=()
command -v buildah >/dev/null || need+=(buildah)
[[ -f $base_tar ]] || command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [[ ${#need[@]} -gt 0 ]]; then
  phase "installing ${need[*]} on this host"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  phase_done "installing"
fi
bh() { buildah --root "$store/storage" --runroot "$store/run" "$@"; }
cleanup() {
  local rc=$?
  bh rm --all >/dev/null 2>&1 || true
  bh rmi --all --force >/dev/null 2>&1 || true
  local m
  for m in $(findmnt -rn -o TARGET | grep -E "^$store(/|$)" | sort -r); do umount "$m" 2>/dev/null || umount -l "$m" || true; done
  rm -rf --one-file-system "$store" "$ctx"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
rm -rf --one-file-system "$store" "$ctx"
mkdir -p "$store" "$work"

if [[ ! -f $base_tar ]]; then
  phase "mmdebstrap --variant=apt bookworm (pristine root filesystem)"
  mmdebstrap --variant=apt --quiet bookworm "$base_tar" "${FRESH_MIRROR:-http://deb.debian.org/debian}" > "$work/mmdebstrap.log" 2>&1
  phase_done "pristine root filesystem"
fi

phase "import $base_tar as localhost/moe-debian12-base"
ctr=$(bh from scratch)
bh add --quiet "$ctr" "$base_tar" / >/dev/null   # a tar archive is unpacked at /
bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
bh commit --quiet --rm "$ctr" localhost/moe-debian12-base:ci >/dev/null
phase_done "import"

phase "buildah bud deploy/docker/Dockerfile (clean clone of $(git rev-parse --short HEAD))"
git clone -q --no-hardlinks "$repo" "$ctx"
bh bud --isolation=chroot --pull=never --quiet \
  --build-arg BUILD_IMAGE=localhost/moe-debian12-base:ci --build-arg RUNTIME_IMAGE=localhost/moe-debian12-base:ci \
  --build-arg JOBS="${JOBS:-$(nproc)}" \
  -f "$ctx/deploy/docker/Dockerfile" -t localhost/moe-expert-service:ci "$ctx" > "$work/container-build.log" 2>&1 \
  || { tail -40 "$work/container-build.log"; echo "container-check: FAILED: buildah bud (log: $work/container-build.log)" >&2; exit 1; }
grep -E "^runtime packages:" "$work/container-build.log" || true
echo "image: $(bh images --format '{{.Name}}:{{.Tag}} {{.Size}}' localhost/moe-expert-service:ci)"
phase_done "image build"

phase "run in the image: --help of every binary, coordinator + expert server + cpu worker session"
ctr=$(bh from --pull=never localhost/moe-expert-service:ci)
set +e
bh run --isolation=chroot --volume "$ctx/deploy/docker/smoke.sh:/usr/local/share/moe/smoke.sh:ro" "$ctr" \
  -- bash /usr/local/share/moe/smoke.sh 2>&1 | tee "$work/container-smoke.log"
rc=${PIPESTATUS[0]}
set -e
phase_done "image session (exit $rc)"
[[ $rc -eq 0 ]] || { echo "container-check: FAILED: the session in the image exited $rc" >&2; exit 1; }
echo "container-check: OK (image built from a pristine Debian 12 base, session answered correctly)"
