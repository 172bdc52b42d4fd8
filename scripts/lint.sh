#!/usr/bin/env bash
# Lint: ruff over the whole tree, then mypy over the installed package (pyproject's [tool.ruff] and [tool.mypy]).
# test.sh runs it before pytest; alone: bash scripts/lint.sh (after scripts/setup.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-${CKPT_ENGINE_VENV:-$ROOT/.venv}}"
cd "$ROOT"
"$VENV/bin/ruff" check .
# mypy cannot follow the editable install's import hook (server/ -> ckpt_engine.server, ...): link the layout
# pip installs, from pyproject's package-dir, under build/mypy/ and check the package there (mypy_path).
TREE="$ROOT/build/mypy"
rm -rf "$TREE"
"$VENV/bin/python" - "$ROOT" "$TREE" <<'PY'
import os, sys
from pathlib import Path
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
root, tree = Path(sys.argv[1]), Path(sys.argv[2])
dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for package, folder in sorted(dirs.items()):
    target = tree.joinpath(*package.split("."))
    target.mkdir(parents=True, exist_ok=True)
    for entry in (root / folder).iterdir():
        if entry.name != "__pycache__" and not target.joinpath(entry.name).exists():
            target.joinpath(entry.name).symlink_to(entry)
PY
# paths in mypy's messages back to the repository's own
"$VENV/bin/mypy" 2>&1 | sed -e "s#^build/mypy/ckpt_engine/\(server\|workers\|cli\|trials\|demos\|bench\)/#\1/#" \
  -e "s#^build/mypy/ckpt_engine/#ckpt_engine/#"
exit "${PIPESTATUS[0]}"
