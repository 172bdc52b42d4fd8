#!/usr/bin/env bash
# Companion of gpu-check.sh, run on a machine WITH internet access: download every wheel that gpu-check.sh may
# need to install on a GPU machine without it (the project's dependencies except torch, pytest with
# pytest-timeout, and checkpoint-engine==0.4.2 for the side by side, with everything they need in turn),
# for one CPython version on manylinux x86-64. Copy the folder to the GPU machine as .whl/ in the repository
# root (git-ignored); gpu-check.sh installs from it only what that machine lacks and keeps its own torch.
#
#   scripts/gpu-wheels.sh [--python 3.12] [--dest DIR] [--platform TAG]... [--nixl CUDA_MAJOR]
#
# --python    target CPython version (default 3.12)
# --dest      folder to fill (default .whl in the repository root)
# --platform  a manylinux tag the target accepts; repeat for several (default: manylinux_2_28_x86_64 and
#             every older manylinux x86-64 tag, i.e. glibc >= 2.28)
# --nixl      also NIXL for the colocated pull (nixl-cu12 or nixl-cu13, the GPU machine's CUDA major; torch's
#             torch.version.cuda there says which): its wheel is ~60 MB, so it is fetched only when asked and
#             slimmed to ~23 MB (gpu_check.py slim-nixl: the parts the nixl transport never loads are left out)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TARGET="3.12"
DEST="$ROOT/.whl"
PLATFORMS=()
NIXL_CUDA=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) TARGET="$2"; shift 2 ;;
    --dest) DEST="$2"; shift 2 ;;
    --platform) PLATFORMS+=("$2"); shift 2 ;;
    --nixl) NIXL_CUDA="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ ${#PLATFORMS[@]} -eq 0 ]; then
  PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64
             manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64
             manylinux_2_5_x86_64 manylinux1_x86_64)
fi
ABI="cp${TARGET//./}"
case "$NIXL_CUDA" in ""|12|13) ;; *) echo "gpu-wheels.sh: --nixl takes 12 or 13 (the CUDA major)" >&2; exit 2 ;; esac
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
if [ -n "$NIXL_CUDA" ]; then
  # No dependencies: NIXL needs torch and numpy, which the GPU machine has.
  rm -f "$DEST"/nixl_cu*.whl
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps --dest "$DEST" \
    --python-version "$TARGET" --implementation cp --abi "$ABI" "${PLATFORM_ARGS[@]}" "$("$PYTHON" "$ROOT/scripts/gpu_check.py" requirements --nixl "$NIXL_CUDA")"
  for wheel in "$DEST"/nixl_cu"$NIXL_CUDA"-*.whl; do "$PYTHON" "$ROOT/scripts/gpu_check.py" slim-nixl "$wheel"; done
fi
