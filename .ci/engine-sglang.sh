#!/usr/bin/env bash
# CI for the SGLang engine on CPU: builds the test rig's venv (rigs/sglang_cpu/build.sh), then runs
# the SGLang tests in it; they must run, not just skip.   bash .ci/engine-sglang.sh
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash rigs/sglang_cpu/build.sh
export SGLANG_USE_CPU_ENGINE=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
.venv-sglang/bin/python -m pytest -m sglang -rs tests/test_engine_sglang.py | tee "$log" || status=${PIPESTATUS[0]}
if [ "$status" = 5 ]; then
    echo "engine-sglang: pytest collected no SGLang test (exit 5): the CPU tests must run" >&2
    exit 1
fi
if [ "$status" != 0 ]; then
    echo "engine-sglang: SGLang tests failed (pytest exit $status)" >&2
    exit "$status"
fi
# every test that can run on CPU must have run: skips are allowed for GPU-only tests only
if grep -E '^SKIPPED' "$log" | grep -v -q 'GPU'; then
    echo "engine-sglang: SGLang tests were skipped on CPU (see the SKIPPED lines above)" >&2
    exit 1
fi
echo "engine-sglang: done in $(( $(date +%s) - t0 )) s"
