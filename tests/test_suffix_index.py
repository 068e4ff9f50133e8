"""The suffix-automaton index against the reference depth-limited trie: counts, drafts (every rule,
chains and trees, ties included), removal, copies, compaction, context matchers, memory."""
from __future__ import annotations

import pickle
import random

import pytest

from methods.suffix.compiled import CompiledIndex, compiled_available
from methods.suffix.index import SuffixIndex
from methods.suffix.tree import START, SuffixTrie, make_tree, resolve_backend

# every check runs on the pure-Python index and on the compiled one (where it was built)
INDEXES = [SuffixIndex, pytest.param(CompiledIndex, marks=pytest.mark.skipif(
    not compiled_available(), reason="the compiled index was not built (no C compiler at install)"))]


def _all_drafts(trie, index, rng, live, vocab, depth, tree):
    """Every rule on both structures, for one live sequence and one random context."""
    seq = rng.choice(live)
    out = []
    for rule in ("speculate", "speculate_longest"):
        for factor, offset in ((1.0, 0.0), (2.0, 0.0), (0.5, 1.0)):
            for min_prob in (0.1, 0.0):
                a = getattr(trie, rule)(trie.own_matches(seq), 8, factor, offset, min_prob, tree)
                b = getattr(index, rule)(index.own_matches(seq), 8, factor, offset, min_prob, tree)
                out.append((a, b))
    context = [rng.randrange(vocab) for _ in range(rng.randint(1, depth + 3))]
    assert [trie.count_of(n) for n in trie.match(context)] == [index.count_of(n) for n in index.match(context)]
    out.append((trie.speculate(trie.match(context), 8, 1.0, 0.0, 0.1, tree),
                index.speculate(index.match(context), 8, 1.0, 0.0, 0.1, tree)))
    for window, min_match in ((7, 2), (4, 1), (depth + 2, 3)):
        out.append((trie.speculate_first_hit(context, window, min_match, 8, 0.1),
                    index.speculate_first_hit(context, window, min_match, 8, 0.1)))
    return out


@pytest.mark.parametrize("depth", [2, 5, 12])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("Index", INDEXES)
def test_drafts_equal_the_trie_call_by_call(Index, depth, tree):
    """Interleaved appends (in-flight rollouts), removals and re-insertions on a small vocabulary
    (ties are everywhere): every draft of every rule equals the trie's, scores to the bit."""
    for seed in range(6):
        rng = random.Random(seed)
        vocab = 3 + seed
        trie, index = SuffixTrie(depth), Index(depth, compact_ratio=1e9)
        live, next_id = [], 0
        for _ in range(250):
            r = rng.random()
            if r < 0.1 or not live:
                trie.extend(next_id, [START])
                index.extend(next_id, [START])
                live.append(next_id)
                next_id += 1
            elif r < 0.14:
                victim = live.pop(rng.randrange(len(live)))
                trie.remove(victim)
                index.remove(victim)
            else:
                seq, tokens = rng.choice(live), [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
                trie.extend(seq, tokens)
                index.extend(seq, tokens)
            if live:
                for a, b in _all_drafts(trie, index, rng, live, vocab, depth, tree):
                    assert a == b


@pytest.mark.parametrize("Index", INDEXES)
def test_counts_are_the_tries_after_removals(Index):
    rng = random.Random(7)
    seqs = {i: [rng.randrange(5) for _ in range(rng.randrange(1, 30))] for i in range(12)}
    trie, index = SuffixTrie(6), Index(6)
    for i, seq in seqs.items():
        for k in range(0, len(seq), 3):
            trie.extend(i, seq[k:k + 3])
            index.extend(i, seq[k:k + 3])
    for i in (3, 0, 7, 11):
        trie.remove(i)
        index.remove(i)
    for seq in seqs.values():
        for a in range(len(seq)):
            for b in range(a + 1, min(len(seq), a + 6) + 1):
                assert ([trie.count_of(n) for n in trie.match(seq[a:b])]
                        == [index.count_of(n) for n in index.match(seq[a:b])])
    assert index.count_of(0) == trie.count_of(0)


@pytest.mark.parametrize("Index", INDEXES)
def test_example_of_the_docstring(Index):
    index = Index(8)
    index.extend(0, [1, 2, 3])
    index.extend(1, [1, 2, 4])
    matches = index.match([1, 2])
    assert len(matches) == 2 and matches[0] == matches[1]
    assert index.count_of(matches[1]) == 2
    assert index.speculate_longest(matches, 4).token_ids == [3]  # equal counts: created first


@pytest.mark.parametrize("Index", INDEXES)
def test_a_copy_counts_like_an_inserted_duplicate(Index):
    """DAS's recency copies: extend_copy equals extending a new sequence with the same tokens,
    and removing the copy (or the source first) restores the counts."""
    rng = random.Random(2)
    trie, index = SuffixTrie(6), Index(6)
    for i in range(20):
        seq = [START] + [rng.randrange(4) for _ in range(rng.randint(1, 15))]
        trie.extend(i, seq)
        index.extend(i, seq)
        if i % 3 == 0:
            trie.extend(100 + i, seq)
            index.extend_copy(100 + i, i)
            assert index.sequence(100 + i) == seq
        if i % 5 == 4:
            trie.remove(100 + i - 4) if 100 + i - 4 in trie else None
            index.remove(100 + i - 4) if 100 + i - 4 in index else None
            trie.remove(i - 1)
            index.remove(i - 1)
        for a, b in _all_drafts(trie, index, rng, [j for j in range(i + 1) if j in trie], 4, 6, False):
            assert a == b


@pytest.mark.parametrize("Index", INDEXES)
def test_compaction_keeps_counts_and_drafts(Index):
    """Removing most of the text rebuilds the automaton from the live sequences (in their time
    order): the memory goes, the counts stay, drafts stay (up to equal-count ties, none here)."""
    rng = random.Random(4)
    trie, index = SuffixTrie(8), Index(8, compact_ratio=0.5)
    for i in range(300):
        seq = [START] + [rng.randrange(50) for _ in range(40)]
        trie.extend(i, seq)
        index.extend(i, seq)
        if i >= 20:
            trie.remove(i - 20)
            index.remove(i - 20)
    # removed text is dropped once it outnumbers the live text 0.5 to 1 (plus 4,096 tokens):
    # about 2 states a token of at most 4,096 + 1.5 x 820 tokens, not of all 12,300
    assert index.num_nodes < 2 * (4096 + 1.5 * 20 * 41) + 100
    for i in range(280, 300):
        seq = index.sequence(i)
        assert [trie.count_of(n) for n in trie.own_matches(i)] == [index.count_of(n) for n in index.own_matches(i)]
        assert trie.speculate(trie.match(seq[:5]), 8) == index.speculate(index.match(seq[:5]), 8)


@pytest.mark.parametrize("Index", INDEXES)
def test_matcher_follows_a_context_outside_the_index(Index):
    rng = random.Random(5)
    trie, index = SuffixTrie(5), Index(5)
    a, b = trie.matcher([START]), index.matcher([START])
    for i in range(60):
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        trie.extend(i, seq)
        index.extend(i, seq)
        if i % 7 == 6:
            trie.remove(i - 3)
            index.remove(i - 3)
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        a.feed(tokens)
        b.feed(tokens)
        assert [trie.count_of(n) for n in a.matches()] == [index.count_of(n) for n in b.matches()]
        assert trie.speculate_longest(a.matches(), 6) == index.speculate_longest(b.matches(), 6)


@pytest.mark.parametrize("Index", INDEXES)
def test_memory_is_linear_in_the_text_whatever_the_depth(Index):
    """A 4,096-token rollout of varied tokens: the trie of depth 64 holds about 64 nodes a token,
    the index about two states a token at any depth."""
    rng = random.Random(0)
    text = [rng.randrange(151_936) for _ in range(4096)]
    for depth in (24, 64, 4096):
        index = Index(depth)
        index.extend(0, text)
        assert index.num_nodes <= 2 * len(text)
    trie = SuffixTrie(64)
    trie.extend(0, text[:1024])
    assert trie.num_nodes > 60 * 1000


@pytest.mark.parametrize("Index", INDEXES)
def test_pickles_and_resumes_identically(Index):
    rng = random.Random(6)
    index = Index(6)
    for i in range(30):
        index.extend(i, [rng.randrange(5) for _ in range(rng.randint(1, 20))])
    index.remove(4)
    copy = pickle.loads(pickle.dumps(index))
    for i in range(30, 40):
        seq = [rng.randrange(5) for _ in range(10)]
        index.extend(i, seq)
        copy.extend(i, seq)
        assert index.speculate(index.own_matches(i), 8) == copy.speculate(copy.own_matches(i), 8)


def test_backends_resolve_to_the_index_or_the_trie():
    assert resolve_backend("python") == "python" and resolve_backend("trie") == "trie"
    assert isinstance(make_tree("python", 8), SuffixIndex)
    assert isinstance(make_tree("trie", 8), SuffixTrie)
    with pytest.raises(ValueError):
        resolve_backend("gpu")


@pytest.mark.skipif(not compiled_available(), reason="the compiled index was not built (no C compiler at install)")
def test_compiled_equals_the_python_index_through_copies_removals_and_compactions():
    """Longer texts than the trie can hold (depth 64, 400-token sequences, vocabulary 30: ties
    everywhere), DAS-style copies, removals that trigger compactions, pickling midway: every draft
    of every rule and the counts equal the Python index's call by call, scores to the bit."""
    rng = random.Random(11)
    a, b = SuffixIndex(64, compact_ratio=0.3), CompiledIndex(64, compact_ratio=0.3)
    live, next_id = [], 0
    for round_ in range(200):
        r = rng.random()
        if r < 0.15 or not live:
            a.extend(next_id, [START]), b.extend(next_id, [START])
            live.append(next_id)
            next_id += 1
        elif r < 0.22 and live:
            src = rng.choice(live)
            a.extend_copy(next_id, src), b.extend_copy(next_id, src)
            live.append(next_id)
            next_id += 1
        elif r < 0.32:
            victim = live.pop(rng.randrange(len(live)))
            a.remove(victim), b.remove(victim)
        else:
            seq = rng.choice(live)
            base = a.sequence(seq)[-rng.randint(1, 40):]  # copy a stretch of itself, with edits
            tokens = [t if rng.random() < 0.8 else rng.randrange(30) for t in base] + \
                [rng.randrange(30) for _ in range(rng.randint(0, 20))]
            a.extend(seq, tokens), b.extend(seq, tokens)
        if round_ == 60:
            b = pickle.loads(pickle.dumps(b))
        if round_ in (40, 90):  # removals alone reach the threshold only past 4,096 dead tokens
            a.compact(), b.compact()
        assert a.num_nodes == b.num_nodes and a.version == b.version and len(a) == len(b)
        for seq in live:
            assert a.sequence(seq) == b.sequence(seq)
            assert [b.sequence_tail(seq, n) for n in (0, 1, 7, 10_000)] == [a.sequence(seq)[-n:] if n else [] for n in (0, 1, 7, 10_000)]
            assert [a.count_of(n) for n in a.own_matches(seq)] == [b.count_of(n) for n in b.own_matches(seq)]
            for tree in (False, True):
                for factor, offset, min_prob in ((1.0, 0.0, 0.1), (2.0, 1.0, 0.0)):
                    args = (24, factor, offset, min_prob, tree)
                    assert a.speculate(a.own_matches(seq), *args) == b.speculate(b.own_matches(seq), *args)
                    assert a.speculate_longest(a.own_matches(seq), *args) == b.speculate_own(seq, True, *args)
                    assert a.speculate(a.own_matches(seq), *args) == b.speculate_own(seq, False, *args)
            context = a.sequence(seq)[-rng.randint(1, 70):]
            assert a.speculate_first_hit(context, 32, 2, 16, 0.1) == b.speculate_first_hit(context, 32, 2, 16, 0.1)
            assert a.match(context) == b.match(context)
