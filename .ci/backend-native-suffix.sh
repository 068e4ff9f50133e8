#!/usr/bin/env bash
# CI for the optional native suffix tree (arctic-inference's C++ SuffixTree): build it from its
# sdist in its own venv and check the pure-Python trie drafts what it drafts.
#   bash .ci/backend-native-suffix.sh          (NATIVE_VENV=.venv-native to override)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NATIVE_VENV:-.venv-native}"
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"   # its bin/ first on PATH, or CMake finds another Python
pip install -q --upgrade pip
pip install -q torch==2.13.0 cmake ninja nanobind==2.9.2 numpy
# --no-deps: the package declares vLLM as a dependency; the suffix tree needs only torch and numpy
pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
pip install -q -e '.[dev]'
python -c 'from arctic_inference.suffix_decoding._C import SuffixTree; print("native SuffixTree built")'
set +e
python -m pytest -q -rs tests/test_suffix_tree.py -k native
rc=$?
set -e
echo "backend-native-suffix took $(( $(date +%s) - start )) s (pytest rc=$rc)"
[ "$rc" -eq 5 ] && echo "error: the native equivalence test was not collected" >&2
exit "$rc"
