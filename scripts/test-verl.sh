#!/usr/bin/env bash
# verl in the loop: sets up its own environment (.venv-verl: the same torch as the project, verl 0.9.1 from
# the registry with what its checkpoint_engine imports, this package) and runs tests/engines_verl against it.
# No GPU needed. CI (.ci/run) runs it after the engine tests.
#
#   bash scripts/test-verl.sh [pytest options]
#
# CKPT_ENGINE_VERL_VENV: use another environment (one that already has torch and verl saves the install).
set -euo pipefail
# shellcheck source=scripts/engine-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/engine-env.sh"
# verl.checkpoint_engine imports uvicorn and fastapi (verl/workers/rollout/utils.py) and its engines pyzmq;
# verl lists them only under its heavy verl-core extra.
engine_env test-verl "${CKPT_ENGINE_VERL_VENV:-$ROOT/.venv-verl}" verl.checkpoint_engine \
  "${CKPT_ENGINE_VERL:-verl==0.9.1}" uvicorn fastapi pyzmq
engine_tests test-verl tests/engines_verl "$@"
