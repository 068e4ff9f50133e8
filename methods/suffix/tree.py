"""The suffix structures every tree drafter shares (SRT, HistoSpec, SuffixDecoding), and the choice among them.

    python -m pytest tests/test_suffix_tree.py -q

Every substring of length <= ``max_depth`` of the inserted sequences is a path from the root;
a node's ``count`` is how often its substring occurs (the root counts inserted tokens). Each
sequence keeps its *active nodes* (the nodes of its last ``max_depth`` suffixes), so appending a
token moves each of them one child down: O(max_depth) per token. Children are ranked by count;
ties go to the child created first (the earlier-inserted continuation), and each node caches
its top child so drafting never sorts. Memory is O(tokens x max_depth) nodes (no path
compression, about 150 bytes a node); ``approx_bytes`` reports it. This trie is the reference
(``backend: trie``); the pure-Python backend (``python``) is ``methods.suffix.index.SuffixIndex``,
a suffix automaton with the same counts, ranks and drafts (ties included) in memory linear in the
text, and ``compiled`` is the same automaton in C (``methods.suffix.compiled.CompiledIndex``,
built by ``pip install -e .`` where a C compiler is at hand): the same drafts to the bit, every
rule, many times faster. ``NativeSuffixTree`` wraps the compressed C++ tree of the
``arctic_inference`` package where that is installed (the ``native`` extra). Every tree drafter
takes ``backend: auto | compiled | python | native | trie`` (``resolve_backend``): auto runs on
``compiled`` where it was built (it computes every rule exactly), else natively where the
package imports and the drafter's rule is one the native tree computes, else on ``python``.

Which rule runs natively (``backend: auto`` picks native only for these):
  * SuffixDecoding's best score over match lengths (``speculate``; chains and trees): tree_cache,
    seer and hybrid with ``match: best``, das (its default), suffix_global.
  * HistoSpec's first hit (``speculate_first_hit``): history_spec, on forced single-length calls
    (one or two native calls per match length tried).
  * SRT's longest match (``speculate_longest``; tree_cache, seer and hybrid's default
    ``match: longest``) has no native form: one native call scores every match length, and
    finding the longest with a continuation would take a call per length. It stays Python
    (``SuffixIndex``: one lookup per automaton state).
Native drafts equal the trie's except where equal counts tie (hash-map order) and where float32
path probabilities round across ``min_prob`` or across another match length's score.
"""
from __future__ import annotations


from methods.suffix.compiled import CompiledIndex, compiled_available
from methods.suffix.index import SuffixIndex
from methods.suffix.native import NativeSuffixTree, native_available
from methods.suffix.speculation import NO_SPECULATION, START, Speculation  # noqa: F401 (re-exported)
from methods.suffix.trie import ROOT, ContextMatcher, SuffixTrie  # noqa: F401 (re-exported)

BACKENDS = ("auto", "compiled", "python", "native", "trie")


def resolve_backend(backend: str, supported: bool = True, what: str = "this drafter") -> str:
    """The backend a drafter runs on: ``compiled`` (``CompiledIndex``, the suffix automaton in C),
    ``python`` (``SuffixIndex``, the same automaton in pure Python), ``native`` or ``trie``
    (``SuffixTrie``, the reference: same drafts as ``python``, O(tokens x max_depth) memory; for
    tests and comparisons).

    ``auto`` picks ``compiled`` where it was built (same drafts as ``python``, every rule), else
    native only where it is importable *and* ``supported`` (the drafter's rule is one the native
    tree computes exactly), so it never changes a method's rule; ``compiled`` and ``native``
    raise where they are missing instead of falling back.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("python", "trie"):
        return backend
    if backend == "compiled" or (backend == "auto" and compiled_available()):
        if not compiled_available():
            raise ImportError("backend compiled needs the C extension methods/suffix/_compiled.c, built by "
                              "pip install -e . where a C compiler (gcc or clang) and the Python headers are "
                              "installed; or use backend python (same drafts, slower)")
        return "compiled"
    if backend == "auto":
        return "native" if supported and native_available() else "python"
    if not supported:
        raise ValueError(f"{what} has no native implementation of its rule: use backend python (or auto)")
    if not native_available():
        raise ImportError("backend native needs arctic-inference's suffix tree: pip install -e '.[native]', then "
                          "pip install --no-build-isolation --no-deps arctic-inference==0.3.0 "
                          "(.ci/backend-native-suffix.sh)")
    return "native"


def make_tree(backend: str, max_depth: int):
    """A CompiledIndex (``compiled``), a SuffixIndex (``python``), a NativeSuffixTree (``native``)
    or a SuffixTrie (``trie``); ``backend`` already resolved."""
    if backend == "compiled":
        return CompiledIndex(max_depth)
    if backend == "native":
        return NativeSuffixTree(max_depth)
    if backend == "trie":
        return SuffixTrie(max_depth)
    return SuffixIndex(max_depth)
