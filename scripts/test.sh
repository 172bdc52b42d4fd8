#!/usr/bin/env bash
# Quick start, command 2: set up and run the test suite (CPU only; no GPU needed). CI runs exactly this.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
# tests/test_operator_page.py opens the daemon's page in Chromium from the distribution's packages; as root
# with apt, install it (without it that test skips and says why)
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
    || echo "test.sh: could not install chromium; the operator page test will be skipped" >&2
fi
# Lint first: ruff and mypy (scripts/lint.sh)
VENV="$VENV" bash "$ROOT/scripts/lint.sh"
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
exit "$rc"
