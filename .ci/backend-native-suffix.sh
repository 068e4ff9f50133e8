#!/usr/bin/env bash
# CI for the optional native suffix tree (arctic-inference's C++ SuffixTree): build it from its
# sdist in its own venv, check the pure-Python trie drafts what it drafts, and run the drafter
# tests and the exactness test with the tree drafters on the native backend (backend: auto picks
# it there for every rule it computes; the tests also force it with match: best).
#   bash .ci/backend-native-suffix.sh          (NATIVE_VENV=.venv-native to override)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NATIVE_VENV:-.venv-native}"
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"   # its bin/ first on PATH, or CMake finds another Python
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e '.[dev,native]'   # native: the build tools (cmake, ninja, nanobind, numpy)
# --no-deps: the package declares vLLM as a dependency; the suffix tree needs only torch and numpy
pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
python -c 'from methods.suffix.tree import native_available; assert native_available(); print("native SuffixTree built")'
set +e
python -m pytest -q -rs tests/test_suffix_tree.py -k native
rc=$?
if [ "$rc" -eq 0 ]; then   # skips are failures here: the native tests must run
    python -m pytest -q -rs tests/test_suffix_tree.py tests/test_suffix_index.py tests/test_drafters.py \
        tests/test_replay.py -k 'not replay or token_identical' 2>&1 | tee /tmp/native-pytest.$$
    rc=${PIPESTATUS[0]}
    grep -q 'native suffix tree is not installed' /tmp/native-pytest.$$ && rc=1
    rm -f /tmp/native-pytest.$$
fi
set -e
echo "backend-native-suffix took $(( $(date +%s) - start )) s (pytest rc=$rc)"
[ "$rc" -eq 5 ] && echo "error: the native equivalence test was not collected" >&2
exit "$rc"
