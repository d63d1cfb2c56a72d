#!/usr/bin/env bash
# Installs the Debian packages the tests need, if they are not installed yet.
#
#   scripts/install-debian-packages.sh [PACKAGE...]   (default: the list below)
#
# Does nothing when every package is installed, so `make test` can call it every time.
# Otherwise it needs root (or sudo). It runs `apt-get update` only when apt knows no
# installable version of a package (fresh machines have empty package lists), so a
# warm machine installs without touching the network for the index.
set -euo pipefail

# docker-compose: tests/test_compose.py validates docker-compose.yml with `docker-compose config`.
# docker.io, debootstrap: tests/test_compose_up.py runs docker-compose.yml under Debian's dockerd
# on base images scripts/make-base-images.sh makes with debootstrap.
# prometheus: tests/test_metrics.py and tests/test_prometheus.py run a real Prometheus server
# (and promtool checks the rules and scrape configs).
DEFAULT_PACKAGES=(docker-compose docker.io debootstrap prometheus)

packages=("$@")
[ ${#packages[@]} -gt 0 ] || packages=("${DEFAULT_PACKAGES[@]}")

installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

has_candidate() {
    local candidate
    candidate="$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}')"
    [ -n "$candidate" ] && [ "$candidate" != "(none)" ]
}

fail() { echo "install-debian-packages.sh: $*" >&2; exit 1; }

missing=()
for package in "${packages[@]}"; do
    installed "$package" || missing+=("$package")
done
[ ${#missing[@]} -gt 0 ] || exit 0

command -v apt-get >/dev/null || fail "apt-get not found; install these packages by hand: ${missing[*]}"
# env, not export: sudo would drop an exported variable.
apt=(env DEBIAN_FRONTEND=noninteractive apt-get)
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || fail "root or sudo is needed to install: ${missing[*]}"
    apt=(sudo "${apt[@]}")
fi

apt_update() {
    echo "install-debian-packages.sh: apt-get update" >&2
    "${apt[@]}" update -qq
}
apt_install() {
    echo "install-debian-packages.sh: installing ${missing[*]}" >&2
    "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}"
}

updated=false
for package in "${missing[@]}"; do
    if ! has_candidate "$package"; then
        apt_update
        updated=true
        break
    fi
done
# Package lists that are there but stale name files the mirror no longer has: refresh once.
if ! apt_install; then
    $updated && fail "apt-get install ${missing[*]} failed"
    apt_update
    apt_install || fail "apt-get install ${missing[*]} failed"
fi
