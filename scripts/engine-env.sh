# Shared by scripts/test-engines.sh and scripts/test-verl.sh (sourced, not run): an environment of its own with
# the project's torch, one engine or framework, this package and pytest; then its tests.
#
#   engine_env NAME VENV IMPORT PACKAGE...   create VENV if needed, install torch and PACKAGE... unless IMPORT works
#                                            (ENGINE_EXTRAS: this package's extras to install too, e.g. "[nixl]")
#   engine_tests NAME TESTDIR [pytest options]   run TESTDIR in that environment; no tests collected is a failure
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
started=$(date +%s)

engine_env() {
  local name="$1" import="$3"
  VENV="$2"
  shift 3
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install --progress-bar off -q)
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "$name: installing ${CKPT_ENGINE_TORCH:-torch==2.13.0} into $VENV" >&2
    # shellcheck disable=SC2086
    "${PIP[@]}" ${CKPT_ENGINE_TORCH:-torch==2.13.0}
  fi
  if ! "$VENV/bin/python" -c "import $import" 2>/dev/null; then
    echo "$name: installing $* into $VENV" >&2
    "${PIP[@]}" "$@"
    ENGINE_INSTALLED=1
  fi
  "${PIP[@]}" -e "$ROOT${ENGINE_EXTRAS:-}" pytest pytest-timeout
  echo "$name: environment ready in $(( $(date +%s) - started ))s" >&2
}

engine_tests() {
  local name="$1" tests="$2" rc
  shift 2
  cd "$ROOT"
  set +e
  "$VENV/bin/python" -m pytest "$tests" -p no:cacheprovider "$@"
  rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "$name: pytest collected no tests; that is a failure here" >&2
    exit 1
  fi
  echo "$name: done in $(( $(date +%s) - started ))s (rc $rc)" >&2
  exit "$rc"
}
