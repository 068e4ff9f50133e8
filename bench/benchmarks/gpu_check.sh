#!/usr/bin/env bash
# The GPU check in one command (see bench/benchmarks/gpu_check.py): bash bench/benchmarks/gpu_check.sh [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python -m bench.benchmarks.gpu_check "$@"
