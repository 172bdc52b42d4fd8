#!/usr/bin/env bash
# Companion of gpu-check.sh, run on a machine WITH internet access: download every wheel that gpu-check.sh may
# need to install on a GPU machine without it (the project's dependencies except torch, pytest with
# pytest-timeout, and checkpoint-engine==0.4.2 for the side by side, with everything they need in turn),
# for one CPython version on manylinux x86-64. Copy the folder to the GPU machine as .whl/ in the repository
# root (git-ignored); gpu-check.sh installs from it only what that machine lacks and keeps its own torch.
#
#   scripts/gpu-wheels.sh [--python 3.12] [--dest DIR] [--platform TAG]...
#
# --python    target CPython version (default 3.12)
# --dest      folder to fill (default .whl in the repository root)
# --platform  a manylinux tag the target accepts; repeat for several (default: manylinux_2_28_x86_64 and
#             every older manylinux x86-64 tag, i.e. glibc >= 2.28)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TARGET="3.12"
DEST="$ROOT/.whl"
PLATFORMS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) TARGET="$2"; shift 2 ;;
    --dest) DEST="$2"; shift 2 ;;
    --platform) PLATFORMS+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ ${#PLATFORMS[@]} -eq 0 ]; then
  PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64
             manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64
             manylinux_2_5_x86_64 manylinux1_x86_64)
fi
ABI="cp${TARGET//./}"
mapfile -t REQS < <("$PYTHON" "$ROOT/scripts/gpu_check.py" requirements)
PLATFORM_ARGS=()
for tag in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$tag"); done
mkdir -p "$DEST"
# The side by side's anchor (MoonshotAI's checkpoint-engine) alone, then what it needs except torch: resolving it
# with its dependencies would download a CUDA torch build, and the GPU machine keeps its own.
ANCHOR="$("$PYTHON" "$ROOT/scripts/gpu_check.py" requirements --anchor | tail -n 1)"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps --dest "$DEST" \
  --python-version "$TARGET" --implementation cp --abi "$ABI" "${PLATFORM_ARGS[@]}" "$ANCHOR"
mapfile -t -O "${#REQS[@]}" REQS < <("$PYTHON" "$ROOT/scripts/gpu_check.py" anchor-deps --wheels "$DEST")
echo "gpu-wheels: CPython $TARGET ($ABI), ${PLATFORMS[0]} and older, into $DEST:" >&2
printf '  %s\n' "${REQS[@]}" >&2
# Binary wheels only (nothing is built on the GPU machine); pip resolves the closure for the target's markers.
"$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --dest "$DEST" \
  --python-version "$TARGET" --implementation cp --abi "$ABI" "${PLATFORM_ARGS[@]}" "${REQS[@]}"
# Check what gpu-check.sh will do with it: a wheel for every requirement, transitively, on that target.
"$PYTHON" "$ROOT/scripts/gpu_check.py" closure --wheels "$DEST" --python "$TARGET" \
  $(for tag in "${PLATFORMS[@]}"; do printf -- '--platform %s ' "$tag"; done)
