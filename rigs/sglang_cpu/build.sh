#!/usr/bin/env bash
# Builds the SGLang CPU test rig venv (.venv-sglang at the repo root) from scratch: a test rig, not
# a supported install (see README.md beside this file).   bash rigs/sglang_cpu/build.sh [--fresh]
set -euo pipefail
RIG="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$RIG/../.." && pwd)"
VENV="${SGLANG_RIG_VENV:-$ROOT/.venv-sglang}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q -c "$RIG/constraints.txt")
t0=$(date +%s)
step() { echo "[sglang-rig +$(( $(date +%s) - t0 ))s] $*"; }

if [ "${1:-}" = "--fresh" ]; then rm -rf "$VENV"; fi
if [ -f "$VENV/.rig-complete" ] && cmp -s "$VENV/.rig-complete" <(cat "$RIG"/*.txt "$RIG"/build.sh "$RIG"/*.py "$RIG"/sgl_kernel_stub/sgl_kernel/*.py); then
    step "$VENV is up to date (rebuild with --fresh)"; exit 0
fi
[ -x "$PY" ] || python3 -m venv "$VENV"

step "torch 2.13.0 (CPU)"
"${PIP[@]}" torch==2.13.0
step "sglang 0.5.23 without its dependencies (they pin torch 2.14.1 and CUDA packages)"
"${PIP[@]}" --no-deps sglang==0.5.23
step "sglang's pure-Python requirements and torchvision 0.28.0"
"${PIP[@]}" -r "$RIG/requirements.txt" torchvision==0.28.0
step "sgl_kernel stand-in"
"${PIP[@]}" --no-build-isolation "$RIG/sgl_kernel_stub"
step "guard torchvision's unconditional fake-op registrations"
"$PY" "$RIG/patch_torchvision.py"
step "this project (editable, dev extra), keeping torch 2.13.0"
"${PIP[@]}" -e "$ROOT[dev]"
"$PY" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"the rig needs torch 2.13.0, found {torch.__version__}"
import os
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
import sglang, transformers
print("torch", torch.__version__, "| sglang", sglang.__version__, "| transformers", transformers.__version__)
PY
cat "$RIG"/*.txt "$RIG"/build.sh "$RIG"/*.py "$RIG"/sgl_kernel_stub/sgl_kernel/*.py > "$VENV/.rig-complete"
step "done: $VENV (set SGLANG_USE_CPU_ENGINE=1 when using it)"
