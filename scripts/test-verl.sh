#!/usr/bin/env bash
# verl in the loop: sets up its own environment (.venv-verl: the same torch as the project, verl 0.9.1 from
# the registry with what its checkpoint_engine imports, this package) and runs tests/engines_verl against it.
# No GPU needed. CI (.ci/run) runs it after the engine tests.
#
#   bash scripts/test-verl.sh [pytest options]
#
# CKPT_ENGINE_VERL_VENV: use another environment (one that already has torch and verl saves the install).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPT_ENGINE_VERL_VENV:-$ROOT/.venv-verl}"
PYTHON="${PYTHON:-python3}"
VERL="${CKPT_ENGINE_VERL:-verl==0.9.1}"
started=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "test-verl: installing ${CKPT_ENGINE_TORCH:-torch==2.13.0} into $VENV" >&2
  # shellcheck disable=SC2086
  "${PIP[@]}" ${CKPT_ENGINE_TORCH:-torch==2.13.0}
fi
if ! "$VENV/bin/python" -c "import verl.checkpoint_engine" 2>/dev/null; then
  echo "test-verl: installing $VERL into $VENV" >&2
  # verl.checkpoint_engine imports uvicorn and fastapi (verl/workers/rollout/utils.py) and its engines pyzmq;
  # verl lists them only under its heavy verl-core extra.
  "${PIP[@]}" "$VERL" uvicorn fastapi pyzmq
fi
"${PIP[@]}" -e "$ROOT" pytest pytest-timeout
echo "test-verl: environment ready in $(( $(date +%s) - started ))s" >&2
cd "$ROOT"
set +e
"$VENV/bin/python" -m pytest tests/engines_verl -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test-verl.sh: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
echo "test-verl: done in $(( $(date +%s) - started ))s (rc $rc)" >&2
exit "$rc"
