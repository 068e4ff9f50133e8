#!/usr/bin/env bash
# The GPU check in one command (see bench/gpu_check.py): bash bench/gpu_check.sh [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m bench.gpu_check "$@"
