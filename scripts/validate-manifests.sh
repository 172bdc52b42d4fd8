#!/usr/bin/env bash
# Validate deploy/'s Kubernetes manifests against the Kubernetes API schemas (strict: unknown fields are
# errors), and the systemd unit with systemd-analyze where there is one. kubernetes-validate (PyPI, pinned)
# ships the schemas in its wheel, so after the first run this works offline; it lives in .venv-tools.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${CKPT_ENGINE_TOOLS_VENV:-$ROOT/.venv-tools}"
K8S_VERSION="${K8S_VERSION:-1.33.0}"
[ -x "$TOOLS/bin/python" ] || python3 -m venv "$TOOLS"
"$TOOLS/bin/kubernetes-validate" --version >/dev/null 2>&1 || \
  "$TOOLS/bin/python" -m pip install --progress-bar off -q "kubernetes-validate==1.37.0"
"$TOOLS/bin/kubernetes-validate" --strict -k "$K8S_VERSION" "$ROOT"/deploy/k8s-*.yaml
if command -v systemd-analyze >/dev/null; then
  # the unit names its own paths (/opt/ckpt-engine/.venv), absent here: only what systemd itself objects to
  systemd-analyze verify "$ROOT/deploy/ckpt-engine.service" 2>&1 | grep -v "/opt/ckpt-engine" || true
fi
