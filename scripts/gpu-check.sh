#!/usr/bin/env bash
# Prove the CUDA path in one command, on a GPU machine with no internet and its own torch build:
#
#   scripts/gpu-check.sh [--dry-run] [--quick] [--wheels DIR] OUTDIR        (from the repository root)
#
# 1. checks that python3 has torch (the machine's own build is kept; nothing reinstalls it);
# 2. installs what is missing or too old from a wheel folder (default .whl/ in the repository root, made on a
#    connected machine by scripts/gpu-wheels.sh) with pip --no-index --target into a folder on PYTHONPATH:
#    no venv, no root, nothing in site-packages;
# 3. stages the package as pip would install it (server/ and workers/ become ckpt_engine.server / .workers);
# 4. runs the GPU tests (tests/gpu), the GPU benchmark section (bench/gpu_bench.py) and the side by side with
#    MoonshotAI's checkpoint-engine 0.4.2 (bench/anchor_bench.py; skipped, saying why, without its wheels), and
#    the colocated NIXL pull beside our CUDA IPC path (bench/nixl_colocated.py; only where NIXL imports: its
#    wheel comes from scripts/gpu-wheels.sh --nixl 13);
# 5. writes OUTDIR/report.md and OUTDIR/report.json, next to the logs and raw results.
#
# Without CUDA it says so, collects the GPU tests (they skip) and exits 0 without running anything GPU-only.
# With CUDA it exits 1 when a test failed or the benchmark did not run (the side by side only reports). The whole
# run is bounded to 14 minutes.
#
# --dry-run    check torch and the wheel plan (read-only), then print every command instead of running it
# --quick      the benchmark's smaller model sizes
# --wheels DIR wheel folder (default $CKPT_WHEELS or .whl)
# Environment: PYTHON (default python3), CKPT_GPU_SITE (install target, default $TMPDIR/ckpt-engine-gpu-site),
#              CKPT_GPU_TEST_TIMEOUT / CKPT_GPU_BENCH_TIMEOUT / CKPT_GPU_ANCHOR_TIMEOUT / CKPT_GPU_NIXL_TIMEOUT
#              (seconds, default 300 / 220 / 300 / 200).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
HELPER="$ROOT/scripts/gpu_check.py"
DRY=0
QUICK=()
WHEELS="${CKPT_WHEELS:-$ROOT/.whl}"
OUT=""
usage() { sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --quick) QUICK=(--quick); shift ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu-check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { echo "gpu-check.sh: one OUTDIR only" >&2; exit 2; }; OUT="$1"; shift ;;
  esac
done
[ -n "$OUT" ] || { echo "gpu-check.sh: OUTDIR is required" >&2; usage >&2; exit 2; }
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
case "$WHEELS" in /*) ;; *) WHEELS="$PWD/$WHEELS" ;; esac
SITE="${CKPT_GPU_SITE:-${TMPDIR:-/tmp}/ckpt-engine-gpu-site}"
TEST_TIMEOUT="${CKPT_GPU_TEST_TIMEOUT:-300}"
BENCH_TIMEOUT="${CKPT_GPU_BENCH_TIMEOUT:-220}"
ANCHOR_TIMEOUT="${CKPT_GPU_ANCHOR_TIMEOUT:-300}"
NIXL_TIMEOUT="${CKPT_GPU_NIXL_TIMEOUT:-200}"
COMMAND="scripts/gpu-check.sh${QUICK[*]:+ ${QUICK[*]}} $OUT"

say() { echo "gpu-check: $*" >&2; }
# Commands with effects go through run: printed (and not run) in a dry run.
run() {
  if [ "$DRY" = 1 ]; then printf '  would run:'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

# 1. torch, and whether there is CUDA (read-only)
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  say "$PYTHON cannot import torch; this check uses the machine's own torch build (set PYTHON=/path/to/python)"
  exit 2
fi
ENV_JSON="$("$PYTHON" "$HELPER" probe)"
CUDA="$(printf '%s' "$ENV_JSON" | "$PYTHON" -c "import json,sys; print(int(json.load(sys.stdin)['cuda_available']))")"
say "machine: $(printf '%s' "$ENV_JSON" | "$PYTHON" -c "
import json, sys; sys.path.insert(0, '$ROOT/scripts'); from gpu_check import describe_machine
print(describe_machine(json.load(sys.stdin)))")"

run mkdir -p "$OUT"
[ "$DRY" = 1 ] || printf '%s\n' "$ENV_JSON" > "$OUT/env.json"

# 2. dependencies: what this machine lacks, from the wheel folder
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! PLAN="$("$PYTHON" "$HELPER" missing --wheels "$WHEELS")"; then
  NOTE="dependencies are missing and cannot be installed from $WHEELS (see the message above)"
  [ "$DRY" = 1 ] || "$PYTHON" "$HELPER" report "$OUT" --command "$COMMAND" --note "$NOTE" >&2
  if [ "$CUDA" = 0 ]; then
    say "no CUDA device here, and the dependencies to collect the GPU tests are missing: nothing GPU-only to run"
    exit 0
  fi
  exit 2
fi
mapfile -t TO_INSTALL < <(printf '%s' "$PLAN" | sed '/^$/d')
INSTALLED=()
if [ ${#TO_INSTALL[@]} -gt 0 ]; then
  for wheel in "${TO_INSTALL[@]}"; do INSTALLED+=("$(basename "$wheel" | cut -d- -f1-2)"); done
  say "installing into $SITE: ${INSTALLED[*]}"
  run "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "${TO_INSTALL[@]}"
else
  say "every dependency is already importable; nothing to install"
fi

# 3. the package, staged as installed; the repository root after it (tests/, bench/)
WORK="${TMPDIR:-/tmp}/ckpt-engine-gpu-check.XXXXXX"
[ "$DRY" = 1 ] || WORK="$(mktemp -d "$WORK")"
trap '[ "$DRY" = 1 ] || rm -rf "$WORK"' EXIT
run "$PYTHON" "$HELPER" stage "$WORK/pkg"
export PYTHONPATH="$WORK/pkg:$PYTHONPATH:$ROOT"

bounded() {  # the command prefix that stops a step after $1 seconds (none without timeout(1))
  if command -v timeout >/dev/null; then echo "timeout --kill-after=15 $1"; else say "no timeout(1): step unbounded"; fi
}
read -r -a TESTS_LIMIT <<< "$(bounded "$TEST_TIMEOUT")"
read -r -a BENCH_LIMIT <<< "$(bounded "$BENCH_TIMEOUT")"
read -r -a ANCHOR_LIMIT <<< "$(bounded "$ANCHOR_TIMEOUT")"
read -r -a NIXL_LIMIT <<< "$(bounded "$NIXL_TIMEOUT")"

# Python runs from the scratch folder: with the repository root as the current directory, its ckpt_engine/
# (without server/ and workers/) would come first on sys.path. pytest appends the root (--import-mode=append).
in_work() { if [ "$DRY" = 1 ]; then run "$@"; else (cd "$WORK" && "$@"); fi; }

if ! in_work "$PYTHON" -c "import ckpt_engine.server, ckpt_engine.workers, fastapi, zmq, pydantic, pytest, pytest_timeout"
then
  NOTE="the staged package or a dependency does not import (see the traceback above)"
  "$PYTHON" "$HELPER" report "$OUT" --command "$COMMAND" --note "$NOTE" --installed "${INSTALLED[@]}" >&2
  say "$NOTE"
  [ "$CUDA" = 0 ] && exit 0
  exit 2
fi

# 4a. GPU tests: collected everywhere, skipped without CUDA
say "GPU tests (tests/gpu), at most ${TEST_TIMEOUT}s"
set +e
in_work "${TESTS_LIMIT[@]}" "$PYTHON" -m pytest "$ROOT/tests/gpu" --rootdir "$ROOT" \
  --import-mode=append -p no:cacheprovider -rA --timeout 150 --junitxml "$OUT/gpu-tests.xml" \
  -o junit_family=xunit2 2>&1 | { if [ "$DRY" = 1 ]; then cat; else tee "$OUT/gpu-tests.log"; fi; }
TESTS_RC=${PIPESTATUS[0]}
set -e

# 4b. GPU benchmark: only with CUDA
BENCH_ARGS=()
if [ "$CUDA" = 1 ]; then
  say "GPU benchmark (bench/gpu_bench.py), at most ${BENCH_TIMEOUT}s"
  set +e
  in_work "${BENCH_LIMIT[@]}" "$PYTHON" -m ckpt_engine.bench.suite --only gpu "${QUICK[@]}" \
    --out "$OUT/gpu-bench.md" --json "$OUT/gpu-bench.json" 2>&1 \
    | { if [ "$DRY" = 1 ]; then cat; else tee "$OUT/gpu-bench.log"; fi; }
  BENCH_RC=${PIPESTATUS[0]}
  set -e
  BENCH_ARGS=(--bench-rc "$BENCH_RC")
elif [ "$DRY" = 1 ]; then
  say "no CUDA device here: the GPU tests would be collected and skipped, the GPU benchmark would not run;"
  say "with CUDA this step would be:"
  in_work "${BENCH_LIMIT[@]}" "$PYTHON" -m ckpt_engine.bench.suite --only gpu "${QUICK[@]}" --out "$OUT/gpu-bench.md" \
    --json "$OUT/gpu-bench.json"
else
  say "no CUDA device here: the GPU tests were collected and skipped, the GPU benchmark is not run"
fi

# 4b'. the colocated NIXL pull beside our CUDA IPC path: only with CUDA and NIXL (optional, like the side by side)
NIXL_SIZE=(--mib 4096)
[ ${#QUICK[@]} -gt 0 ] && NIXL_SIZE=(--mib 1024)
NIXL_CMD=("${NIXL_LIMIT[@]}" "$PYTHON" -m ckpt_engine.bench.nixl_colocated "${NIXL_SIZE[@]}" --deadline-s "$NIXL_TIMEOUT"
          --out "$OUT/nixl-colocated.md" --json "$OUT/nixl-colocated.json")
if [ "$CUDA" = 1 ] && in_work "$PYTHON" -c "from ckpt_engine.transport.nixl import nixl_api; nixl_api()" 2>/dev/null
then
  say "the colocated NIXL pull (bench/nixl_colocated.py), at most ${NIXL_TIMEOUT}s"
  set +e
  in_work "${NIXL_CMD[@]}" 2>&1 | { if [ "$DRY" = 1 ]; then cat; else tee "$OUT/nixl-colocated.log"; fi; }
  BENCH_ARGS+=(--nixl-rc "${PIPESTATUS[0]}")
  set -e
elif [ "$DRY" = 1 ]; then
  say "with CUDA and NIXL (scripts/gpu-wheels.sh --nixl 12 or 13: the CUDA major of the torch wheel) the colocated NIXL pull would be:"
  in_work "${NIXL_CMD[@]}"
else
  say "the colocated NIXL pull is skipped (it needs CUDA and NIXL: scripts/gpu-wheels.sh --nixl 12 or 13, the CUDA major of the torch wheel)"
fi

# 4c. side by side with MoonshotAI's checkpoint-engine: only with CUDA; it says itself when their package is missing
ANCHOR_CMD=("${ANCHOR_LIMIT[@]}" "$PYTHON" -m ckpt_engine.bench.anchor_bench "${QUICK[@]}" --out "$OUT/anchor-bench.md"
            --json "$OUT/anchor-bench.json")
if [ "$CUDA" = 1 ]; then
  say "side by side with MoonshotAI's checkpoint-engine (bench/anchor_bench.py), at most ${ANCHOR_TIMEOUT}s"
  set +e
  in_work "${ANCHOR_CMD[@]}" 2>&1 | { if [ "$DRY" = 1 ]; then cat; else tee "$OUT/anchor-bench.log"; fi; }
  BENCH_ARGS+=(--anchor-rc "${PIPESTATUS[0]}")
  set -e
elif [ "$DRY" = 1 ]; then
  say "with CUDA the side by side with MoonshotAI's checkpoint-engine would be:"
  in_work "${ANCHOR_CMD[@]}"
else
  say "no CUDA device here: the side by side with MoonshotAI's checkpoint-engine is skipped"
fi

# 5. report
run "$PYTHON" "$HELPER" report "$OUT" --command "$COMMAND" --tests-rc "$TESTS_RC" "${BENCH_ARGS[@]}" \
  --installed "${INSTALLED[@]}"
[ "$DRY" = 1 ] && { say "dry run: nothing was installed, staged or run"; exit 0; }
if [ "$CUDA" = 0 ]; then
  [ "$TESTS_RC" = 0 ] || say "the GPU tests did not collect and skip cleanly (pytest exit code $TESTS_RC)"
  exit 0
fi
if [ "$TESTS_RC" != 0 ] || [ "${BENCH_RC:-1}" != 0 ]; then
  say "FAILED: tests exit code $TESTS_RC, benchmark exit code ${BENCH_RC:-none}; see $OUT/report.md"
  exit 1
fi
say "OK: see $OUT/report.md"
