#!/usr/bin/env bash
# Fills wheelhouse/ (in the build context, not in git) with every wheel the image installs, so
# that `docker build` needs no network: the Dockerfile installs from it with --no-index.
#
#   scripts/fill-wheelhouse.sh [PYTHON]    (default python3; pip runs on the host)
#
# The wheels are for the image's Python (3.11, Linux, this machine's architecture) whatever
# the host's Python is. A wheelhouse filled for the same pins is left as it is (the stamp file
# records them); otherwise wheels already there are kept and the rest fetched. torch is
# the CPU build of the pin in constraints.txt: from pip's configured indexes when they carry it
# (this project's machines keep it on disk), else from PyTorch's CPU index, $TORCH_INDEX_URL.
set -euo pipefail
self="$(realpath "$0")"
cd "$(dirname "$self")/.."

PYTHON="${1:-python3}"
OUT=wheelhouse
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
# The image's interpreter: debootstrap's bookworm (glibc 2.36) and python:3.11-slim alike.
# pip takes each manylinux tag the image accepts as a --platform of its own.
target=(--only-binary=:all: --implementation cp --python-version 3.11 --abi cp311)
for glibc in $(seq 17 36); do target+=(--platform "manylinux_2_${glibc}_$(uname -m)"); done
target+=(--platform "manylinux2014_$(uname -m)")

mkdir -p "$OUT"
stamp="$OUT/filled-for.sha256"
pins="$(cat constraints.txt pyproject.toml "$self" | sha256sum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ]; then
    exit 0
fi
rm -f "$stamp"
pip=("$PYTHON" -m pip download --quiet --dest "$OUT" --find-links "$OUT" "${target[@]}")
torch="$(grep -E '^torch==' constraints.txt)+cpu"

# torch alone first: a +cpu build is asked for by name, so no index's CUDA build can stand in.
"${pip[@]}" --no-deps "$torch" 2>/dev/null \
    || "${pip[@]}" --no-deps --index-url "$TORCH_INDEX_URL" "$torch"

# The package's dependencies (pyproject.toml), what builds it (setuptools), and pip itself,
# which the Dockerfile runs from its wheel (Debian's Python has no pip).
requirements="$(mktemp)"
trap 'rm -f "$requirements"' EXIT
"$PYTHON" - >"$requirements" <<'EOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
print("\n".join(project["project"]["dependencies"] + project["build-system"]["requires"] + ["pip"]))
EOF
echo "$torch" >>"$requirements"
"${pip[@]}" -c constraints.txt -r "$requirements"
echo "$pins" >"$stamp"
echo "fill-wheelhouse.sh: $(ls "$OUT" | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT/" >&2
