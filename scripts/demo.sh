#!/usr/bin/env bash
# Quick start, command 1: set up and run the main job (trainer + 2 receivers doing real syncs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
exec "$VENV/bin/ckpt-engine" demo "$@"
