#!/usr/bin/env bash
# CI for Hydra's Ray launcher: its own venv (hydra-ray-launcher pins cloudpickle 2.2.1, which the
# joblib launcher of the main venv does not want), then the two-job sweep on a local Ray cluster,
# which must run, not skip.   bash .ci/launcher-ray.sh            (RAY_VENV=.venv-ray to override)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RAY_VENV:-.venv-ray}"
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip
pip install -q -e '.[cpu,dev,ray]'
set +e
python -m pytest -q -rs tests/test_ray_launcher.py | tee "$VENV/pytest.log"
rc=${PIPESTATUS[0]}
set -e
echo "launcher-ray took $(( $(date +%s) - start )) s (pytest rc=$rc)"
if [ "$rc" -eq 0 ] && grep -q -E '^SKIPPED' "$VENV/pytest.log"; then
    echo "error: the Ray launcher test was skipped: the ray extra did not install" >&2
    exit 1
fi
[ "$rc" -eq 5 ] && echo "error: the Ray launcher test was not collected" >&2
exit "$rc"
