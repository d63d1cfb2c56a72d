#!/usr/bin/env bash
# Makes the images docker-compose.yml needs from Debian's archive alone, for machines that
# reach no container registry (docs/running.md "Containers"):
#
#   diloco-base:bookworm        Debian bookworm (debootstrap --variant=minbase) with Python 3.11:
#                               the Dockerfile's BASE_IMAGE in place of python:3.11-slim
#   diloco-prometheus:bookworm  the same with Debian's prometheus package: PROMETHEUS_IMAGE
#                               in place of prom/prometheus
#
#   scripts/make-base-images.sh [--force]
#
# An image the docker image store already has is kept (--force makes both again), so the store
# is the cache between runs. Needs root (debootstrap), docker and debootstrap; the mirror is
# $DEBIAN_MIRROR (default deb.debian.org).
set -euo pipefail

SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_IMAGE="diloco-base:$SUITE"
PROMETHEUS_IMAGE="diloco-prometheus:$SUITE"
# passwd: the Dockerfile adds the image's user with groupadd and useradd.
BASE_PACKAGES="python3 passwd"

fail() { echo "make-base-images.sh: $*" >&2; exit 1; }
force=false
case "${1:-}" in
    "") ;;
    --force) force=true ;;
    *) fail "unknown argument $1 (usage: scripts/make-base-images.sh [--force])" ;;
esac
[ "$(id -u)" -eq 0 ] || fail "debootstrap needs root"
command -v debootstrap >/dev/null || fail "debootstrap not found: scripts/install-debian-packages.sh installs it"
docker info >/dev/null 2>&1 || fail "no docker daemon answers (docker info)"

have() { ! $force && docker image inspect "$1" >/dev/null 2>&1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# One minbase root filesystem, made when the first image needs it; each image starts as a copy.
minbase() {
    [ -d "$work/minbase" ] && return
    echo "make-base-images.sh: debootstrap --variant=minbase $SUITE" >&2
    debootstrap --variant=minbase "$SUITE" "$work/minbase" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap failed"; }
}

# The minbase with `packages` installed by its own apt (debootstrap left it the suite's package
# lists and the host's resolv.conf), changed by the `prepare` function, trimmed, and imported as
# `tag` with the docker import --change options that follow. Each image is one layer.
make_image() {
    local tag="$1" packages="$2" prepare="$3"; shift 3
    local root="$work/root"
    minbase
    echo "make-base-images.sh: $tag: $packages" >&2
    cp -a "$work/minbase" "$root"
    # No package may start a service in the chroot.
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
    chmod +x "$root/usr/sbin/policy-rc.d"
    # shellcheck disable=SC2086 # the package list splits on spaces
    chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        $packages >"$work/apt.log" 2>&1 || { tail -20 "$work/apt.log" >&2; fail "apt-get install $packages failed"; }
    "$prepare" "$root"
    # What no container needs: apt's package lists and downloads, documentation, locales, and
    # the host's files (docker gives each container its own resolv.conf and hostname).
    rm -rf "$root"/usr/sbin/policy-rc.d "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* \
        "$root"/var/cache/debconf/*-old "$root"/usr/share/doc "$root"/usr/share/man \
        "$root"/usr/share/info "$root"/usr/share/locale "$root"/etc/resolv.conf "$root"/etc/hostname
    tar --numeric-owner -C "$root" -c . | docker import "$@" - "$tag" >/dev/null
    rm -rf "$root"
    echo "make-base-images.sh: made $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes)" >&2
}

nothing() { :; }
have "$BASE_IMAGE" || make_image "$BASE_IMAGE" "$BASE_PACKAGES" nothing \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]'

# As prom/prometheus runs: as the `prometheus` user the package adds, its data in /prometheus
# (a volume in docker-compose.yml starts as a copy of this folder, owner included).
# Of moment-timezone (214 MB with its data) the web UI loads one file.
prometheus_data() {
    chroot "$1" install -d -o prometheus -g prometheus /prometheus
    find "$1/usr/share/javascript/moment-timezone" -mindepth 1 \
        ! -name moment-timezone-with-data.min.js -exec rm -rf {} +
}
have "$PROMETHEUS_IMAGE" || make_image "$PROMETHEUS_IMAGE" prometheus prometheus_data \
    --change 'USER prometheus' \
    --change 'WORKDIR /prometheus' \
    --change 'EXPOSE 9090' \
    --change 'ENTRYPOINT ["/usr/bin/prometheus"]' \
    --change 'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
