"""The shared suffix trie on literal token lists: counts, ties, min_prob, budgets, match choice, trees, removal."""
from __future__ import annotations

import random

import pytest

from methods.suffix_tree import ROOT, START, ContextMatcher, NativeSuffixTree, SuffixTrie


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
