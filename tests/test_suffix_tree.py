"""The shared suffix trie on literal token lists: counts, ties, min_prob, budgets, match choice, trees, removal."""
from __future__ import annotations

import random

import pytest

from methods.suffix.tree import ROOT, START, ContextMatcher, NativeSuffixTree, SuffixTrie


def trie_of(*seqs, depth=8):
    trie = SuffixTrie(depth)
    for seq_id, seq in enumerate(seqs):
        trie.extend(seq_id, seq)
    return trie


def counts(trie):
    """{substring: count} for every node below the root."""
    out, stack = {}, [((), ROOT)]
    while stack:
        path, node = stack.pop()
        for token, child in trie.children(node).items():
            out[path + (token,)] = trie.count_of(child)
            stack.append((path + (token,), child))
    return out


def brute_counts(seqs, depth):
    out = {}
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                out[tuple(seq[i:j])] = out.get(tuple(seq[i:j]), 0) + 1
    return out


def test_counts_are_occurrences_and_depth_is_limited():
    trie = trie_of([1, 2, 1, 2, 3], depth=3)
    c = counts(trie)
    assert trie.count_of(ROOT) == 5  # one suffix start per token
    assert c[(1,)] == 2 and c[(1, 2)] == 2 and c[(1, 2, 1)] == 1 and c[(2, 1, 2)] == 1
    assert (1, 2, 1, 2) not in c  # deeper than max_depth 3
    assert trie.num_nodes == 1 + len(c)


def test_random_inserts_and_removals_match_brute_force_counts():
    rng = random.Random(7)
    seqs = {i: [rng.randrange(5) for _ in range(rng.randrange(1, 30))] for i in range(12)}
    trie = SuffixTrie(6)
    for i, seq in seqs.items():  # interleaved appends, as in-flight rollouts arrive
        for k in range(0, len(seq), 3):
            trie.extend(i, seq[k:k + 3])
    for i in (3, 0, 7, 11):
        trie.remove(i)
        del seqs[i]
    assert counts(trie) == brute_counts(seqs.values(), 6)
    assert trie.num_nodes == 1 + len(counts(trie))  # pruned nodes are gone, not zero-count


def test_tie_goes_to_the_earlier_inserted_child_until_a_count_breaks_it():
    trie = trie_of([1, 2, 1, 3])
    # after [1]: 2 and 3 both follow once; 2 was inserted first, so it is drafted
    assert trie.speculate(trie.match([1]), 4).token_ids == [2]
    trie.extend(1, [1, 3])
    # now 3 follows twice and 2 once: the count wins
    assert trie.speculate(trie.match([1]), 4).token_ids == [3]


def test_min_prob_cuts_the_path():
    trie = trie_of([1, 2, 3], [1, 2, 4], [1, 5])
    matches = trie.match([1])
    # [1] -> 2 with share 2/3, then 3 with share 1/2: path probabilities 2/3 then 1/3
    assert trie.speculate(matches, 8, offset=5, min_prob=0.3).token_ids == [2, 3]
    # 1/3 < 0.4: the second token is cut
    assert trie.speculate(matches, 8, offset=5, min_prob=0.4).token_ids == [2]
    # 2/3 < 0.7: nothing survives
    assert trie.speculate(matches, 8, offset=5, min_prob=0.7).token_ids == []


def test_budget_comes_from_match_length_factor_and_offset():
    trie = trie_of([1, 2, 3, 4, 5, 6, 7, 8])
    matches = trie.match([2, 3])  # match lengths 1 ([3]) and 2 ([2, 3])
    # floor(2 * 1.0 + 0) = 2 tokens from the length-2 match
    assert trie.speculate(matches, 24).token_ids == [4, 5]
    # floor(2 * 2.0) = 4
    assert trie.speculate(matches, 24, factor=2.0).token_ids == [4, 5, 6, 7]
    # floor(2 * 1.0 + 1) = 3
    assert trie.speculate(matches, 24, offset=1.0).token_ids == [4, 5, 6]
    # floor(2 * 0.5) = 1 (and the length-1 match gets floor(0.5) = 0)
    assert trie.speculate(matches, 24, factor=0.5).token_ids == [4]
    # max_spec_tokens caps every budget
    assert trie.speculate(matches, 1, factor=2.0).token_ids == [4]


def test_shorter_match_wins_on_a_strictly_better_score():
    trie = trie_of([7, 1, 2, 9], [1, 2, 3, 4], [1, 2, 3, 4])
    spec = trie.speculate(trie.match([7, 1, 2]), 24)
    # length 3 ([7, 1, 2]) drafts [9] (then the response ends): score 1.0;
    # length 2 ([1, 2]) drafts [3, 4] with path probabilities 2/3, 2/3: score 4/3 > 1
    assert spec.token_ids == [3, 4] and spec.match_len == 2
    assert spec.score == pytest.approx(4 / 3)


def test_equal_scores_go_to_the_longer_match():
    trie = trie_of([3, 3, 4], [3, 3, 2])
    spec = trie.speculate(trie.match([3, 3]), 24)
    # length 1 ([3]): 3 follows 2 of the 4 occurrences -> [3], score 0.5
    # length 2 ([3, 3]): 4 and 2 follow once each, 4 first -> [4], score 0.5: tie, longer wins
    assert spec.token_ids == [4] and spec.match_len == 2 and spec.score == 0.5


def test_tree_draft_expands_best_first_with_parents():
    trie = trie_of([1, 2, 3], [1, 2, 4], [1, 5], [1, 5])
    matches = trie.match([1])
    spec = trie.speculate(matches, 8, offset=5, tree=True)
    # [1] -> 2 (1/2) and 5 (1/2): both roots; 2 was inserted first so it is node 0.
    # 2 -> 3 and 4 at 1/4 each (parent 0); 5 has no continuation.
    assert spec.token_ids == [2, 5, 3, 4]
    assert spec.parents == [-1, -1, 0, 0]
    assert spec.score == pytest.approx(0.5 + 0.5 + 0.25 + 0.25)
    spec.draft().validate()
    # the token budget keeps the most probable nodes; min_prob drops the 1/4 ones
    assert trie.speculate(matches, 3, offset=5, tree=True).token_ids == [2, 5, 3]
    assert trie.speculate(matches, 8, offset=5, min_prob=0.3, tree=True).parents == [-1, -1]


def test_removal_restores_drafts_and_prunes_nodes():
    trie = trie_of([1, 2])
    before = (trie.num_nodes, counts(trie))
    trie.extend(1, [1, 3])
    trie.extend(2, [1, 3])
    assert trie.speculate(trie.match([1]), 4).token_ids == [3]  # 3 follows twice
    trie.remove(1)
    trie.remove(2)
    # back to one sequence: 2 is the top child again and the [1, 3]/[3] nodes are pruned
    assert trie.speculate(trie.match([1]), 4).token_ids == [2]
    assert (trie.num_nodes, counts(trie)) == before
    trie.remove(0)
    assert trie.num_nodes == 1 and trie.count_of(ROOT) == 0 and trie.top_child(ROOT) is None


def test_first_hit_uses_the_longest_matching_pattern_even_if_shorter_scores_better():
    trie = trie_of([9, 1, 2, 3, 4, 5], [7, 1, 2, 3, 4, 6], [8, 1, 2, 3, 4, 6])
    # [9, 1, 2, 3, 4] (length 5) hits and continues with 5; the length-4 pattern [1, 2, 3, 4]
    # would prefer 6 (2 of 3) but a longer pattern already hit
    spec = trie.speculate_first_hit([0, 9, 1, 2, 3, 4], 7, 4, 8, 0.1)
    assert spec.token_ids == [5] and spec.match_len == 5
    # [0, 2, 3, 4] never occurred and [2, 3, 4] is shorter than min_match 4: no draft
    assert trie.speculate_first_hit([0, 2, 3, 4], 7, 4, 8, 0.1).token_ids == []
    # the window bounds the pattern: with window 4 only [1, 2, 3, 4] is tried, and 6 wins
    assert trie.speculate_first_hit([0, 9, 1, 2, 3, 4], 4, 4, 8, 0.1).token_ids == [6]


def test_first_hit_skips_a_match_without_continuation():
    trie = trie_of([1, 2, 3, 4, 5], [6, 2, 3, 4, 5, 7])
    # [1, 2, 3, 4, 5] occurs only where a response ended: no continuation, so not a hit;
    # [2, 3, 4, 5] continues with 7 in one of its 2 occurrences (1/2 >= 0.1)
    spec = trie.speculate_first_hit([1, 2, 3, 4, 5], 7, 4, 8, 0.1)
    assert spec.token_ids == [7] and spec.match_len == 4


def test_own_matches_are_the_active_nodes():
    trie = trie_of([START, 5, 6, 7, 8], depth=4)
    trie.extend(1, [START, 5, 6])
    own = trie.own_matches(1)
    assert own == trie.match([START, 5, 6])  # the same nodes, shallowest first
    # the earlier sequence continues [START, 5, 6] with 7, 8; the own occurrence ends there
    assert trie.speculate(own, 24).token_ids == [7, 8]


def test_context_matcher_follows_a_growing_context_and_rematches_after_changes():
    rng = random.Random(3)
    trie = SuffixTrie(5)
    for i in range(6):
        trie.extend(i, [rng.randrange(4) for _ in range(40)])
    context = [rng.randrange(4) for _ in range(3)]
    matcher = ContextMatcher(trie, context)
    for step in range(60):
        new = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        context += new
        matcher.feed(new)
        if step % 7 == 0:
            trie.extend(100 + step, [rng.randrange(4) for _ in range(10)])
        if step % 11 == 0:
            trie.remove(step // 11)
        assert matcher.matches() == trie.match(context)


def test_context_matches_of_an_inserted_sequence_equal_a_fresh_match():
    rng = random.Random(4)
    trie = SuffixTrie(6)
    for i in range(20):
        trie.extend(i, [rng.randrange(3) for _ in range(rng.randrange(1, 12))])
    for i in range(20):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(0, 8))]
        # a response shorter than the depth: longer suffixes reach into the prompt
        assert trie.context_matches(i, prompt + trie.sequence(i)) == trie.match(prompt + trie.sequence(i))


def test_longest_rule_drafts_from_the_longest_match_with_a_continuation():
    trie = trie_of([7, 1, 2, 9], [1, 2, 3, 4], [1, 2, 3, 4])
    matches = trie.match([5, 7, 1, 2])  # [2], [1, 2], [7, 1, 2]; [5, 7, 1, 2] never occurred
    # [7, 1, 2] (budget 3) continues with 9 only, and wins although [1, 2] -> [3, 4] scores more
    spec = trie.speculate_longest(matches, 24)
    assert spec.token_ids == [9] and spec.match_len == 3 and spec.score == 1.0
    trie.extend(3, [6, 2])
    # [6, 2] occurs once, where sequence 3 ends: no continuation, so the next shorter match
    # drafts: [2] (4 occurrences) is followed by 3 twice, by 9 once: [3] at share 1/2 (budget 1)
    spec = trie.speculate_longest(trie.match([6, 2]), 24)
    assert spec.token_ids == [3] and spec.match_len == 1 and spec.score == 0.5


def native_or_skip(depth):
    try:
        return NativeSuffixTree(depth)
    except ImportError:
        pytest.skip("the optional native suffix tree is not installed")


@pytest.mark.parametrize("tree", [False])
def test_pure_python_drafts_equal_native_ones(tree):
    depth = 16
    native = native_or_skip(depth)
    rng = random.Random(11)
    trie = SuffixTrie(depth)
    same = 0
    for seq_id in range(3000):
        seq = [rng.randrange(8) for _ in range(rng.randrange(5, 60))]
        trie.extend(seq_id, seq)
        native.extend(seq_id, seq)
        if seq_id >= 50 and rng.random() < 0.3:
            victim = rng.randrange(seq_id - 40)
            if victim in trie:
                trie.remove(victim)
                native.remove(victim)
        context = [rng.randrange(8) for _ in range(depth + 4)]  # longer than depth, as in vLLM
        ours = trie.speculate(trie.match(context), 8, 1.0, 0.0, 0.1, tree)
        theirs = native.speculate(context, 8, 1.0, 0.0, 0.1, tree)
        if theirs.token_ids == ours.token_ids:
            assert theirs.score == pytest.approx(ours.score, rel=1e-5)
            same += 1
        else:  # allowed only through equal-count children (its children sit in a hash map)
            node = trie.match(context)[theirs.match_len - 1]
            for token in theirs.token_ids:
                child = trie.children(node)[token]
                assert trie.count_of(child) == trie.count_of(trie.top_child(node))
                node = child
    assert same > 0.9 * 3000, f"only {same} of 3000 drafts identical"


class ReleasedCache:
    """ArcticInference's SuffixDecodingCache call sequence on the native tree: a local tree of
    prompt + response per request, a global slot taken at start (FIFO eviction over cached and
    running responses), add_active_response into both, the global draft on a strictly higher
    score, the response kept at stop."""

    def __init__(self, depth, max_cached):
        self.depth, self.max_cached = depth, max_cached
        self.global_tree = NativeSuffixTree(depth)
        self.local, self.slot, self.order, self.filled = {}, {}, [], set()

    def start(self, req, prompt):
        tree = NativeSuffixTree(self.depth)
        tree.extend(0, prompt)
        self.local[req] = (tree, list(prompt))
        seq = len(self.order)
        self.slot[req] = seq
        self.order.append((req, seq))
        cached = [(r, s) for r, s in self.order if s is not None]
        while len(cached) > self.max_cached:
            r, s = cached.pop(0)
            if s in self.filled:
                self.global_tree.remove(s)
                self.filled.discard(s)
            self.order[s] = (r, None)
            if self.slot.get(r) == s:
                del self.slot[r]

    def add_active_response(self, req, tokens):
        tree, context = self.local[req]
        tree.extend(0, tokens)
        context += tokens
        if req in self.slot:
            self.global_tree.extend(self.slot[req], tokens)
            self.filled.add(self.slot[req])

    def speculate(self, req, k):
        tree, context = self.local[req]
        pattern = context[-self.depth:]
        own = tree.speculate(pattern, k, 1.0, 0.0, 0.1, False)
        glob = self.global_tree.speculate(pattern, k, 1.0, 0.0, 0.1, False)
        return own, glob

    def stop(self, req):
        del self.local[req]


def _tie_explained(trie, matches, spec):
    """A native draft that differs from ours only by following equal-count children."""
    assert spec.match_len <= len(matches), "the native tree matched a suffix ours did not"
    node = matches[spec.match_len - 1]
    for token in spec.token_ids:
        child = trie.children(node)[token]
        assert trie.count_of(child) == trie.count_of(trie.top_child(node))
        node = child


def test_suffix_global_drafts_equal_the_native_released_cache():
    from methods.base import Rollout, RolloutKey
    from methods.suffix_global import OWN, SuffixGlobalDrafter
    depth, cap, k = 12, 40, 8
    native_or_skip(depth)
    native = ReleasedCache(depth, cap)
    ours = SuffixGlobalDrafter(max_depth=depth, max_cached_responses=cap, max_spec_tokens=k, backend="python")
    ours.begin_step(0)
    rng = random.Random(5)
    phrases = [[rng.randrange(6) for _ in range(5)] for _ in range(4)]  # responses repeat phrases
    running, calls, same = {}, 0, 0
    for req in range(600):
        key = RolloutKey(f"q{req % 7}", req)
        prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
        native.start(req, prompt)
        ours.start(key, prompt)
        running[req] = (key, prompt, [], rng.randrange(5, 40))
        for r, (rk, rprompt, output, length) in list(running.items()):
            theirs_own, theirs_global = native.speculate(r, k)
            own = ours._own_tree(rk)  # built at the first proposal; build it now to compare
            longest = min(len(rprompt) + len(output), depth) - 1  # the native stops one short of the pattern
            mine_own = own.speculate(own.own_matches(OWN)[:longest], k, 1.0, 0.0, 0.1)
            global_matches = ours._global_matches(rk, own)[:longest]
            mine_global = ours.global_trie.speculate(global_matches, k, 1.0, 0.0, 0.1)
            draft = ours.propose(rk, list(output), k)
            theirs = theirs_global if theirs_global.score > theirs_own.score else theirs_own
            calls += 1
            if theirs.token_ids == draft.token_ids:
                same += 1
            for m, t, trie, matches in ((mine_own, theirs_own, own, own.own_matches(OWN)[:longest]),
                                        (mine_global, theirs_global, ours.global_trie, global_matches)):
                if t.token_ids == m.token_ids:
                    assert t.score == pytest.approx(m.score, rel=1e-5)
                else:
                    _tie_explained(trie, matches, t)
            new = rng.choice(phrases)[:rng.randrange(1, 4)] if rng.random() < 0.7 else [rng.randrange(6)]
            new = new[:length - len(output)]
            output += new
            native.add_active_response(r, new)
            ours.observe(rk, new)
            if len(output) >= length:
                native.stop(r)
                ours.finish(rk, Rollout(rk, 0, rprompt, list(output), [0.0] * len(output), "length"))
                del running[r]
        if len(running) > 6:  # keep a handful running at once
            r = next(iter(running))
            rk, rprompt, output, _ = running.pop(r)
            native.stop(r)
            ours.finish(rk, Rollout(rk, 0, rprompt, list(output), [0.0] * len(output), "length"))
    assert ours.stats()["evictions"] > 0 and ours.stats()["global_wins"] > 0
    assert same > 0.9 * calls, f"only {same} of {calls} drafts identical"


# ----- the native backend: rules on top of the native tree, backend choice, pickling -----

def _random_trees(depth, rng, n_seqs=300, vocab=8):
    native, trie = native_or_skip(depth), SuffixTrie(depth)
    for seq_id in range(n_seqs):
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        for k in range(0, len(seq), 5):  # interleaved chunks, as in-flight rollouts arrive
            trie.extend(seq_id, seq[k:k + 5])
            native.extend(seq_id, seq[k:k + 5])
        if seq_id >= 20 and rng.random() < 0.3:
            victim = rng.randrange(seq_id - 10)
            trie.remove(victim)
            native.remove(victim)
    return native, trie


@pytest.mark.parametrize("tree", [False, True])
def test_native_speculate_seq_equals_the_trie_on_own_matches_up_to_ties(tree):
    """``speculate_seq`` (sentinel-prefixed context) is the trie's rule over every own match
    length, short sequences whole included; differences only through equal counts."""
    rng = random.Random(21)
    native, trie = _random_trees(10, rng, vocab=12)
    same = calls = 0
    for seq_id in list(trie._seqs):
        for extra in ([], [rng.randrange(12)]):
            if extra:
                trie.extend(seq_id, extra)
                native.extend(seq_id, extra)
            ours = trie.speculate(trie.own_matches(seq_id), 8, 1.0, 0.0, 0.1, tree)
            theirs = native.speculate_seq(seq_id, 8, 1.0, 0.0, 0.1, tree)
            assert native.sequence(seq_id) == trie.sequence(seq_id)
            assert native.sequence_tail(seq_id, 5) == trie.sequence_tail(seq_id, 5) == trie.sequence(seq_id)[-5:]
            calls += 1
            if theirs.token_ids == ours.token_ids:
                same += 1
                assert theirs.score == pytest.approx(ours.score, rel=1e-5)
            elif tree:  # best-first over the same probabilities: ties reorder, never change the score
                assert theirs.score == pytest.approx(ours.score, rel=1e-5)
                assert len(theirs.token_ids) == len(ours.token_ids)
            else:
                _tie_explained(trie, trie.own_matches(seq_id), theirs)
    # trees take every equal-probability sibling, so on 12 tokens they tie far more than chains
    assert same > (0.3 if tree else 0.8) * calls, f"only {same} of {calls} drafts identical"


def test_native_first_hit_equals_the_trie_up_to_ties():
    rng = random.Random(8)
    native, trie = _random_trees(24, rng, n_seqs=200, vocab=5)
    same = calls = 0
    for _ in range(2000):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        min_prob = rng.choice([0.0, 0.1, 0.3])
        ours = trie.speculate_first_hit(context, 7, 4, 16, min_prob)
        theirs = native.speculate_first_hit(context, 7, 4, 16, min_prob)
        calls += 1
        if theirs.token_ids == ours.token_ids:
            same += 1
            if ours.token_ids:
                assert theirs.match_len == ours.match_len
        else:  # the same hit (match length), a different path only through equal counts
            assert theirs.match_len == ours.match_len
            _tie_explained(trie, trie.match(context), theirs)
    assert same > 0.8 * calls, f"only {same} of {calls} drafts identical"


def test_native_tree_pickles_as_its_log_and_drafts_identically_after_loading():
    import pickle
    rng = random.Random(2)
    native = native_or_skip(12)
    live = []
    for seq_id in range(400):  # many removals: the log is compacted (the tree rebuilt) several times
        native.extend(seq_id, [rng.randrange(6) for _ in range(rng.randrange(1, 30))])
        live.append(seq_id)
        if len(live) > 30:
            native.remove(live.pop(rng.randrange(len(live))))
    copy = pickle.loads(pickle.dumps(native))
    assert len(copy) == len(native) and all(copy.sequence(s) == native.sequence(s) for s in live)
    assert len(copy._log_tok) == len(native._log_tok) <= 2 * native._live_tokens + 4096 + 1
    for step in range(300):  # identical later drafts (ties included) through more extends and removes
        seq_id = rng.choice(live)
        new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        for t in (native, copy):
            t.extend(seq_id, new)
        if step % 20 == 0:
            victim = live.pop(rng.randrange(len(live)))
            native.remove(victim)
            copy.remove(victim)
        context = [rng.randrange(6) for _ in range(14)]
        for tree in (False, True):
            assert copy.speculate(context, 8, 1.0, 0.0, 0.1, tree) == native.speculate(context, 8, 1.0, 0.0, 0.1, tree)
        assert copy.speculate_seq(seq_id, 8) == native.speculate_seq(seq_id, 8)
        assert copy.speculate_first_hit(context, 7, 4, 16, 0.1) == native.speculate_first_hit(context, 7, 4, 16, 0.1)


def test_backend_choice_never_changes_a_rule(monkeypatch):
    from methods.suffix import tree as suffix_tree
    from methods.tree_cache import TreeCacheDrafter
    with pytest.raises(ValueError, match="backend must be one of"):
        suffix_tree.resolve_backend("cuda")
    assert suffix_tree.resolve_backend("python") == "python"
    # the compiled index computes every rule exactly: auto takes it wherever it was built
    monkeypatch.setattr(suffix_tree, "compiled_available", lambda: True)
    assert suffix_tree.resolve_backend("auto", supported=False) == "compiled"
    assert suffix_tree.resolve_backend("compiled") == "compiled"
    monkeypatch.setattr(suffix_tree, "compiled_available", lambda: False)  # installed without a C compiler
    with pytest.raises(ImportError, match="C compiler"):
        suffix_tree.resolve_backend("compiled")
    # longest match has no native form: auto keeps Python, native refuses
    assert TreeCacheDrafter(match="longest", backend="auto").backend == "python"
    with pytest.raises(ValueError, match="no native implementation"):
        TreeCacheDrafter(match="longest", backend="native")
    monkeypatch.setattr(suffix_tree, "native_available", lambda: False)  # a machine without the package
    assert suffix_tree.resolve_backend("auto") == "python"
    with pytest.raises(ImportError, match="native"):
        suffix_tree.resolve_backend("native")
    monkeypatch.setattr(suffix_tree, "native_available", lambda: True)
    assert suffix_tree.resolve_backend("auto", supported=True) == "native"
    assert suffix_tree.resolve_backend("auto", supported=False) == "python"


def test_native_suffix_global_drafts_equal_the_released_cache_exactly():
    """The native-backed drafter makes the released calls: identical drafts, ties included."""
    from methods.base import Rollout, RolloutKey
    from methods.suffix_global import SuffixGlobalDrafter
    depth, cap, k = 12, 40, 8
    native_or_skip(depth)
    released = ReleasedCache(depth, cap)
    ours = SuffixGlobalDrafter(max_depth=depth, max_cached_responses=cap, max_spec_tokens=k, backend="native")
    ours.begin_step(0)
    rng = random.Random(6)
    phrases = [[rng.randrange(6) for _ in range(5)] for _ in range(4)]
    running = {}
    for req in range(300):
        key = RolloutKey(f"q{req % 7}", req)
        prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
        released.start(req, prompt)
        ours.start(key, prompt)
        running[req] = (key, prompt, [], rng.randrange(5, 40))
        for r, (rk, rprompt, output, length) in list(running.items()):
            theirs_own, theirs_global = released.speculate(r, k)
            theirs = theirs_global if theirs_global.score > theirs_own.score else theirs_own
            assert ours.propose(rk, list(output), k).token_ids == theirs.token_ids
            new = rng.choice(phrases)[:rng.randrange(1, 4)][:length - len(output)]
            output += new
            released.add_active_response(r, new)
            ours.observe(rk, new)
            if len(output) >= length or len(running) > 6:
                released.stop(r)
                ours.finish(rk, Rollout(rk, 0, rprompt, list(output), [0.0] * len(output), "length"))
                del running[r]
    assert ours.stats()["evictions"] > 0 and ours.stats()["global_wins"] > 0
