#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install ckpt-engine with its test tools.
# Sourced by demo.sh and test.sh; safe to run again (it only installs what is missing or changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPT_ENGINE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off -q)
# torch first and pinned: an unpinned torch would resolve to the newest release with several GB of CUDA
# wheels. Override for your platform, e.g. CKPT_ENGINE_TORCH="torch --index-url <your CPU/CUDA index>".
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing ${CKPT_ENGINE_TORCH:-torch==2.13.0} into $VENV" >&2
  # shellcheck disable=SC2086
  "${PIP[@]}" ${CKPT_ENGINE_TORCH:-torch==2.13.0}
fi
# test tools, and matplotlib for the benchmark plots (ckpt-engine bench)
"${PIP[@]}" -e "$ROOT[test,bench]"
