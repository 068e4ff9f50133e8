"""Every drafter on literal token lists, driven in the engine's call order; every method config instantiates."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from methods.base import Draft, Drafter, Rollout, RolloutKey
from methods.history_spec import HistorySpecDrafter
from methods.hybrid import HybridDrafter
from methods.prefix_reuse import PrefixReuseDrafter
from methods.das import DASDrafter
from methods.seer import SeerDrafter
from methods.suffix_global import SuffixGlobalDrafter
from methods.tree_cache import TreeCacheDrafter

ROOT = Path(__file__).resolve().parents[1]
P0, P1 = RolloutKey("p", 0), RolloutKey("p", 1)


def rollout(key, tokens, step=0, logprobs=None):
    logprobs = logprobs if logprobs is not None else [-1.0] * len(tokens)
    return Rollout(key, step, [0], list(tokens), list(logprobs), "stop")


def drive(drafter, key, target, step=0, prompt=(0,), budget=64, logprobs=None, finish=True):
    """Run one rollout as an exact-rule engine would, with ``target`` as the sampled tokens:
    accept the chain draft while it agrees with target, emit one more target token, observe."""
    drafter.start(key, list(prompt))
    output, drafts = [], []
    while len(output) < len(target):
        draft = drafter.propose(key, list(output), budget)
        draft.validate()
        drafts.append(list(draft.token_ids))
        accepted = 0
        while (accepted < len(draft) and len(output) + accepted < len(target)
               and draft.token_ids[accepted] == target[len(output) + accepted]):
            accepted += 1
        new = list(target[len(output):len(output) + accepted + 1])
        output += new
        drafter.observe(key, new)
    if finish:
        drafter.finish(key, rollout(key, target, step, logprobs))
    return drafts


# ----- prefix reuse (SPEC-RL) -----

def test_prefix_reuse_drafts_the_whole_previous_response_once_with_logprobs():
    d = PrefixReuseDrafter()
    d.begin_step(0)
    assert drive(d, P0, [4, 9, 2], logprobs=[-0.1, -0.5, -0.2]) == [[], [], []]  # nothing cached yet
    d.begin_step(1)
    d.start(P0, [0])
    # the engine budget truncates the old response (and its logprobs) to 2 tokens
    assert d.propose(P0, [], 2) == Draft([4, 9], None, [-0.1, -0.5])
    d.start(P0, [0])
    assert d.propose(P0, [], 8) == Draft([4, 9, 2], None, [-0.1, -0.5, -0.2])
    # after the first draft (or at any output length > 0) it proposes nothing
    assert d.propose(P0, [], 8) == Draft()
    assert d.propose(P0, [4], 8) == Draft()


def test_prefix_reuse_counts_skips_and_accepted_prefixes():
    d = PrefixReuseDrafter()
    d.begin_step(0)
    drive(d, P0, [4, 9, 2])
    drive(d, P1, [1, 2])
    d.begin_step(1)
    # slot 0 keeps 4, 9 and then samples 7: accepted prefix 2 of 3, not a skip
    assert drive(d, P0, [4, 9, 7], step=1)[0] == [4, 9, 2]
    # slot 1 repeats its old response exactly: the whole draft is accepted (a skip)
    assert drive(d, P1, [1, 2], step=1)[0] == [1, 2]
    s = d.stats()
    assert s["drafted_rollouts"] == 2 and s["full_reuse_rollouts"] == 1
    assert s["skip_ratio"] == 0.5
    assert s["mean_accepted_prefix"] == 2.0  # (2 + 2) / 2
    assert s["cache_entries"] == 2 and s["cache_tokens"] == 5  # the step-1 rollouts replaced step 0's


# ----- tree cache (SRT) -----

def test_tree_cache_siblings_share_in_flight_tokens_within_a_step():
    d = TreeCacheDrafter()
    d.begin_step(0)
    drive(d, P0, [5, 6, 7, 8], finish=False)  # sibling 0 is still running
    d.start(P1, [0])
    d.observe(P1, [5])
    d.observe(P1, [6])
    # sibling 1's context [START, 5, 6] occurred once in sibling 0 (and in itself, where it
    # has no continuation yet): share 1/2 for 7, then 1 for 8 -> two tokens, score 1.0
    assert d.propose(P1, [5, 6], 24) == Draft([7, 8])


def test_tree_cache_without_in_flight_updates_sees_only_finished_rollouts():
    d = TreeCacheDrafter(in_flight=False)
    d.begin_step(0)
    drive(d, P0, [5, 6, 7, 8], finish=False)
    d.start(P1, [0])
    d.observe(P1, [5, 6])
    assert d.propose(P1, [5, 6], 24) == Draft()  # sibling 0 has not finished
    d.finish(P0, rollout(P0, [5, 6, 7, 8]))
    # now the trie holds [START, 5, 6, 7, 8] and P1 is not inside it: share 1 for 7 and 8
    assert d.propose(P1, [5, 6], 24) == Draft([7, 8])


def test_tree_cache_drafts_the_response_start_from_earlier_steps_and_keeps_prompts_apart():
    d = TreeCacheDrafter()
    d.begin_step(0)
    drive(d, P0, [5, 6, 7, 8])
    d.begin_step(1)
    d.start(P0, [0])
    # at output [] the context is [START]: 5 started 1 of the 2 responses (the other is this
    # one, empty so far) -> share 1/2, budget floor(1 * 1.0) = 1 for match length 1
    assert d.propose(P0, [], 24) == Draft([5])
    other = RolloutKey("q", 0)
    d.start(other, [0])
    assert d.propose(other, [], 24) == Draft()  # prompt q has its own (empty) trie


def test_tree_cache_aborted_rollout_keeps_its_tokens_and_does_no_harm():
    d = TreeCacheDrafter(run_ahead=True)
    d.begin_step(0)
    ahead = RolloutKey("next", 0)
    drive(d, ahead, [3, 4, 5, 6], finish=False)  # a run-ahead request aborted at the batch end
    d.begin_step(1)
    # the prompt's real visit: the aborted tokens are in its trie. At [START] the first
    # token 3 (share 1/2, budget 1); 3 is accepted and 4 emitted; at [START, 3, 4] the
    # length-3 match drafts 5 and 6 (1/2 each, budget 3, then the aborted tokens end)
    drafts = drive(d, ahead, [3, 4, 5, 6], step=1)
    assert drafts == [[3], [5, 6]]
    assert d.stats()["sequences"] == 2


def test_tree_cache_tree_mode_returns_parents():
    d = TreeCacheDrafter(tree=True, offset=4)
    d.begin_step(0)
    drive(d, P0, [1, 2, 3])
    drive(d, P1, [1, 4, 3])
    d.begin_step(1)
    d.start(P0, [0])
    d.observe(P0, [1])
    # context [START, 1] (3 occurrences, 2 earlier ones continue with 2 and 4: 1/3 each),
    # each continued by 3 (1/3 again). Equal probabilities pop in creation order: 2, then the
    # 3 after it (created while rollout 0 ran), then 4 and its 3: a tree with two branches
    draft = d.propose(P0, [1], 24)
    assert draft.token_ids == [2, 3, 4, 3] and draft.parents == [-1, 0, -1, 2]


# ----- history spec (RhymeRL) -----

def test_history_spec_uses_only_the_last_visit_and_stays_static():
    d = HistorySpecDrafter()
    d.begin_step(0)
    drive(d, P0, [1, 2, 3, 4, 5, 6])
    d.start(P1, [0])
    # the previous visit is still running: no trie yet, and sibling tokens are not inserted
    assert d.propose(P1, [1, 2, 3], 16) == Draft()
    d.finish(P1, rollout(P1, [1, 2, 3, 9, 9, 9]))
    d.begin_step(1)
    # the tries are rebuilt between steps, before any rollout of the next one starts (off its clock)
    assert d.stats()["prompts"] == 1 and d.stats()["collected_responses"] == 0
    d.start(P0, [0])
    # pattern [START, 1, 2, 3] (length 4) hits: 4 and 9 follow once each, 4 inserted first;
    # the AIMD length starts at 2
    assert d.propose(P0, [1, 2, 3], 16) == Draft([4, 5])
    d.finish(P0, rollout(P0, [7, 7, 7, 7, 7], step=1))
    d.start(P1, [0])
    assert d.propose(P1, [1, 2, 3], 16) == Draft([4, 5])  # static during visit 1
    d.begin_step(2)
    d.start(P0, [0])
    # visit 2 sees only visit 1's response [7, 7, 7, 7, 7]
    assert d.propose(P0, [1, 2, 3], 16) == Draft()
    assert d.propose(P0, [7, 7, 7], 16) == Draft([7, 7])


def test_history_spec_aimd_doubles_to_16_and_halves_to_2():
    d = HistorySpecDrafter()
    d.begin_step(0)
    old = list(range(100, 200))
    drive(d, P0, old)
    d.begin_step(1)
    d.start(P0, [0])
    out = old[:10]
    lengths = []
    for _ in range(5):  # full acceptance each time: 2 -> 4 -> 8 -> 16 -> 16 (cap)
        draft = d.propose(P0, out, 64)
        lengths.append(len(draft))
        d.observe(P0, draft.token_ids + [old[len(out) + len(draft)]])
        out = old[:len(out) + len(draft) + 1]
    assert lengths == [2, 4, 8, 16, 16]
    for expected in (16, 8, 4, 2, 2):  # only the first token accepted: halve, floor 2
        draft = d.propose(P0, out, 64)
        assert len(draft) == expected
        d.observe(P0, [draft.token_ids[0], -5])
        # (the acceptance is read from observe only; keep drafting on the old response)
    assert d.draft_length(P0) == 2
    assert d.stats()["aimd_grow"] == 5 and d.stats()["aimd_shrink"] == 5


# ----- suffix decoding (global control) -----

def test_suffix_global_evicts_the_oldest_response_first():
    # the earlier control (responses cached at finish), where a running request holds no slot
    d = SuffixGlobalDrafter(max_cached_responses=2, in_flight=False)
    d.begin_step(0)
    drive(d, RolloutKey("a", 0), [1, 2, 3])
    drive(d, RolloutKey("b", 0), [4, 5, 6])
    d.start(P0, [0])
    d.observe(P0, [1])
    # [1] occurred once in the global trie, followed by 2 (budget 1 for match length 1)
    assert d.propose(P0, [1], 24) == Draft([2])
    drive(d, RolloutKey("c", 0), [7, 8, 9])  # third response: [1, 2, 3] is evicted
    assert d.cached_sequence_ids() == [1, 2] and d.stats()["evictions"] == 1
    d.start(P1, [0])
    d.observe(P1, [1])
    assert d.propose(P1, [1], 24) == Draft()
    d.observe(P1, [4])
    assert d.propose(P1, [1, 4], 24) == Draft([5])  # [4, 5, 6] is still cached


def test_suffix_global_uses_the_own_prompt_trie_when_it_scores_better():
    d = SuffixGlobalDrafter()
    d.begin_step(0)
    drive(d, RolloutKey("a", 0), [4, 9])
    d.start(P0, [3, 4, 5, 3, 4])
    # own trie: [3, 4] occurred before, followed by 5 (1/2, the other occurrence is the
    # current end) then 3: [5, 3], score 1.0; the global [4] -> 9 scores 1.0 with budget 1:
    # a tie, and the own trie wins ties
    assert d.propose(P0, [], 24) == Draft([5, 3])
    assert d.stats()["own_wins"] == 1


def test_suffix_global_as_released_drafts_from_a_running_response():
    d = SuffixGlobalDrafter()
    d.begin_step(0)
    drive(d, RolloutKey("a", 0), [3, 4, 5, 6], finish=False)  # request a is still running
    q = RolloutKey("q", 0)
    d.start(q, [9])
    d.observe(q, [3])
    # a's tokens entered the global trie as they were generated (add_active_response); [3]
    # occurs there twice, in a's response and in q's own so far, and 4 follows one: share
    # 1/2, budget 1 for match length 1. q's own trie [9, 3] has no continuation of [3]
    assert d.propose(q, [3], 24) == Draft([4])
    control = SuffixGlobalDrafter(in_flight=False)
    control.begin_step(0)
    drive(control, RolloutKey("a", 0), [3, 4, 5, 6], finish=False)
    control.start(q, [9])
    control.observe(q, [3])
    assert control.propose(q, [3], 24) == Draft()  # the control sees a only once it finishes


def test_suffix_global_as_released_takes_a_slot_at_start_and_evicts_fifo():
    d = SuffixGlobalDrafter(max_cached_responses=2)
    d.begin_step(0)
    drive(d, RolloutKey("a", 0), [1, 2, 3])
    drive(d, RolloutKey("b", 0), [4, 5, 6])
    d.start(P0, [0])  # P0's slot is the third: a's [1, 2, 3] is evicted now, not at P0's finish
    assert d.cached_sequence_ids() == [1, 2] and d.stats()["evictions"] == 1
    d.observe(P0, [1])
    assert d.propose(P0, [1], 24) == Draft()  # [1] occurs only in P0's own response: no continuation
    d.start(P1, [0])  # fourth slot: b is evicted, P0 (running) is now the oldest
    d.start(RolloutKey("c", 0), [0])  # fifth: P0's running response is evicted and stops growing
    assert d.cached_sequence_ids() == [3, 4] and d.stats()["evictions"] == 3
    d.observe(P0, [2, 7])
    d.observe(P1, [1, 2])
    # P0's tokens never reached the global trie after its eviction: P1's [1, 2] is only its own
    assert d.propose(P1, [1, 2], 24) == Draft()
    d.finish(P0, rollout(P0, [1, 2, 7]))
    assert d.cached_sequence_ids() == [3, 4]


# ----- SRT's match rule -----

def test_tree_cache_longest_match_wins_even_where_a_shorter_one_scores_better():
    drafts = {}
    for rule in ("longest", "best"):
        d = TreeCacheDrafter(match=rule)
        d.begin_step(0)
        for i, target in enumerate([[7, 1, 2, 9], [1, 2, 3, 4], [1, 2, 3, 4]]):
            drive(d, RolloutKey("p", i), target)
        d.begin_step(1)
        d.start(P0, [0])
        d.observe(P0, [7, 1, 2])
        drafts[rule] = d.propose(P0, [7, 1, 2], 24)
    # the longest match [START, 7, 1, 2] (2 occurrences: rollout 0 and this one) continues
    # with 9 at share 1/2: SRT drafts [9] (score 0.5); the best-score rule prefers the
    # length-2 match [1, 2] (4 occurrences, 3 follows twice, then 4): [3, 4], score 1.0
    assert drafts == {"longest": Draft([9]), "best": Draft([3, 4])}


# ----- DAS -----

def test_das_window_ages_out_rollouts_of_old_steps():
    # every request long (thresholds 0 tokens), no recency copies: only the window acts
    d = DASDrafter(window_steps=2, recent_weight=1, length_unit="tokens", short_max=0, long_min=0)
    d.begin_step(0)
    drive(d, P0, [1, 2, 3])
    d.begin_step(1)
    # [START] occurs twice (step 0's rollout and this one): 1 at share 1/2, then 2; budget
    # floor(1 x factor 2.0) = 2
    assert drive(d, P0, [7, 8, 9], step=1)[0] == [1, 2]
    d.begin_step(2)
    # step 0 is 2 steps old: aged out. Only step 1's [7, 8, 9] is left to draft from (SRT's
    # tree would still rank 1 first: 1 and 7 tie, the earlier-inserted wins)
    d.start(P0, [0])
    assert d.propose(P0, [], 24) == Draft([7, 8])
    assert d.stats()["window_sequences"] == 2  # step 1's rollout and this running one


def test_das_recent_rollouts_count_twice_until_they_age():
    drafts = {}
    for weight in (2, 1):
        d = DASDrafter(recent_steps=2, recent_weight=weight, length_unit="tokens", short_max=0, long_min=0)
        d.begin_step(0)
        drive(d, P0, [1, 2])
        d.begin_step(1)
        drive(d, P0, [3, 4], step=1)
        d.begin_step(2)  # step 0's copy expires here, step 1's is still fresh
        d.start(P0, [0])
        drafts[weight] = d.propose(P0, [], 24)
    # weight 2: [START] is followed by 1 once (step 0) and by 3 twice (step 1 and its copy):
    # 3 wins at share 2/4, then 4. Weight 1: 1 and 3 once each, the earlier-inserted 1 wins
    assert drafts == {2: Draft([3, 4]), 1: Draft([1, 2])}


def test_das_length_classes_set_the_budget_and_running_requests_are_upgraded():
    d = DASDrafter(length_unit="tokens", short_max=3, long_min=6, long_budget=24, medium_budget=2,
                   short_budget=0, recent_weight=1)
    d.begin_step(0)
    long_, medium, short = RolloutKey("l", 0), RolloutKey("m", 0), RolloutKey("s", 0)
    drive(d, long_, [1, 2, 3, 4, 5, 6, 7, 8])  # 8 tokens: long from the next step
    drive(d, medium, [1, 2, 3, 4, 5])  # 5: medium
    drive(d, short, [1, 2])  # 2: short
    fresh, sibling = RolloutKey("u", 0), RolloutKey("u", 1)
    drive(d, fresh, list(range(1, 11)))  # prompt u finished once, but its class waits for the next step
    d.start(sibling, [0])
    d.observe(sibling, [1, 2, 3])
    # u is unseen as the step began: medium, at most 2 tokens although the match allows 8
    assert d.propose(sibling, [1, 2, 3], 24) == Draft([4, 5])
    d.observe(sibling, [4, 5, 6])
    # its own output reached 6 tokens: upgraded to long, the match length 7 allows 14
    assert d.propose(sibling, [1, 2, 3, 4, 5, 6], 24) == Draft([7, 8, 9, 10])
    d.begin_step(1)
    d.reset_stats()  # as the harness does at every step
    for key, budget_draft in ((long_, [4, 5, 6, 7, 8]), (medium, [4, 5])):
        d.start(key, [0])
        d.observe(key, [1, 2, 3])
        # [START, 1, 2, 3] continues as last visit did (share 1/2); match length 4 x 2.0 = 8
        # tokens allowed, then the class budget: long 24 (the old rollout's end cuts it), medium 2
        assert d.propose(key, [1, 2, 3], 24) == Draft(budget_draft)
    d.start(short, [0])
    assert d.propose(short, [], 24) == Draft()  # short: no draft, though [START] -> 1 is in the trie
    s = d.stats()
    assert (s["short_proposals"], s["medium_proposals"], s["long_proposals"]) == (1, 1, 1)


def test_das_thresholds_scale_with_the_rollout_cap():
    d = DASDrafter()  # short below 1/16 of the cap, long from 1/4
    d.begin_step(0)
    d.start(P0, [0])
    d.propose(P0, [], 23)  # the engine's budget at output [] is cap - 1: the cap is 24
    d.finish(P0, rollout(P0, [1] * 9))
    assert d.stats()["length_cap"] == 24
    d.begin_step(1)
    # 9 tokens >= 24 / 4: long; an unseen prompt is medium; 1 token < 24 / 16: short
    assert d.length_class("p", 0) == 2 and d.length_class("other", 0) == 1 and d.length_class("other", 6) == 2


# ----- Seer -----

def test_seer_hands_the_pool_to_the_longest_running_rows_first():
    got = {}
    for pool in (3, 2, None):
        d = SeerDrafter(max_batch_draft_tokens=pool)
        d.begin_step(0)
        drive(d, RolloutKey("p", 0), [5, 6, 7, 8, 9])
        s1, s2 = RolloutKey("p", 1), RolloutKey("p", 2)
        for key, out in ((s1, [5, 6, 7]), (s2, [5])):
            d.start(key, [0])
            d.observe(key, out)
        d.begin_iteration([(s2, 1), (s1, 3)])  # batch order does not matter: length does
        got[pool] = (d.propose(s2, [5], 24), d.propose(s1, [5, 6, 7], 24))
    # sibling 1 has run longest: [START, 5, 6, 7] -> [8, 9] (share 1/2 each) comes out of the
    # pool first. Pool 3 leaves 1 token for sibling 2 ([START, 5]: 6 follows 2 of its 3
    # occurrences, then 7): [6]; pool 2 leaves none; no pool: sibling 2 gets its full [6, 7]
    assert got[3] == (Draft([6]), Draft([8, 9]))
    assert got[2] == (Draft(), Draft([8, 9]))
    assert got[None] == (Draft([6, 7]), Draft([8, 9]))


def test_seer_group_trie_holds_this_steps_siblings_only():
    for history, expected in ((False, Draft()), (True, Draft([1]))):
        d = SeerDrafter(history=history)
        d.begin_step(0)
        drive(d, P0, [1, 2, 3])
        d.begin_step(1)
        d.start(P0, [0])
        d.begin_iteration([(P0, 0)])
        # the group's trie starts empty each step; with history the last visit's [1, 2, 3]
        # gives [START] -> 1 (share 1/2, budget 1)
        assert d.propose(P0, [], 24) == expected


def test_seer_without_the_engine_hook_drafts_per_row():
    d = SeerDrafter(max_batch_draft_tokens=0)
    d.begin_step(0)
    drive(d, P0, [5, 6, 7, 8])
    d.reset_stats()
    d.start(P1, [0])
    d.observe(P1, [5, 6])
    # no begin_iteration this iteration: no pool to share, the plain tree-cache draft
    assert d.propose(P1, [5, 6], 24) == Draft([7, 8])
    assert d.stats()["unallocated_proposals"] == 1
    d.begin_iteration([(P1, 2)])
    assert d.propose(P1, [5, 6], 24) == Draft()  # pool 0: nobody drafts


# ----- hybrid (ours) -----

def test_hybrid_drafts_the_old_response_first_and_the_tree_afterwards():
    d = HybridDrafter()
    d.begin_step(0)
    drive(d, P0, [1, 2, 3, 1, 2, 3])
    d.begin_step(1)
    d.reset_stats()  # step 0 drafted from the tree too ([1, 2, 3] repeats): count step 1 only
    d.start(P0, [0])
    first = d.propose(P0, [], 64)
    assert first.token_ids == [1, 2, 3, 1, 2, 3] and first.logprobs == [-1.0] * 6
    d.observe(P0, [1, 2, 7])  # 1, 2 accepted, 7 sampled
    # [7] has never been followed by anything: the tree has no draft, prefix reuse is spent
    assert d.propose(P0, [1, 2, 7], 64) == Draft()
    d.observe(P0, [1])
    # [1] occurs 4 times (2 old, 2 own) and is followed by 2 in 3 of them -> [2], budget 1
    assert d.propose(P0, [1, 2, 7, 1], 64) == Draft([2])
    d.finish(P0, rollout(P0, [1, 2, 7, 1, 2], step=1))
    s = d.stats()
    assert s["prefix_drafted_rollouts"] == 1 and s["prefix_mean_accepted_prefix"] == 2.0
    assert s["tree_drafts"] == 1


# ----- protocol and configs -----

CONFIGS = sorted((ROOT / "conf" / "method").glob("*.yaml"))


def test_all_method_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"baseline", "prefix_reuse", "prefix_reuse_exact", "tree_cache", "tree_cache_tree",
            "tree_cache_runahead", "history_spec", "suffix_global", "hybrid", "das", "seer"} <= names


def _with_policy(drafter):
    """A drafter that reads the policy's model (``attach_policy``: the EAGLE-style head) gets a tiny
    random one, as the replay hands it the step's checkpoint; others are returned as they are."""
    if hasattr(drafter, "attach_policy"):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        drafter.attach_policy(LlamaForCausalLM(LlamaConfig(
            vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2)).eval())
    return drafter


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_instantiates_and_runs_the_protocol(path):
    cfg = OmegaConf.load(path)
    assert cfg.name == path.stem
    assert cfg.verify.rule in ("exact", "ratio", "greedy-compatible")
    if cfg.verify.rule == "ratio":
        assert cfg.verify.lenience == pytest.approx(math.exp(0.5))
    drafter = _with_policy(instantiate(cfg.drafter))
    assert isinstance(drafter, Drafter)
    responses = [[1, 2, 3, 4, 1, 2, 3, 5], [1, 2, 3, 4, 1, 2, 3, 5, 6]]
    for step in range(3):  # begin_step, then start/propose/observe/finish per rollout
        drafter.begin_step(step)
        for i, target in enumerate(responses):
            drive(drafter, RolloutKey("p", i), target, step=step)
    if hasattr(drafter, "stats"):
        stats = drafter.stats()
        assert all(isinstance(v, (int, float)) for v in stats.values())
    if cfg.name == "tree_cache_runahead":
        assert drafter.run_ahead is True


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_drafter_state_pickles_and_resumes_identically(path):
    import pickle
    drafter = _with_policy(instantiate(OmegaConf.load(path).drafter))
    responses = [[1, 2, 3, 4, 1, 2, 3, 5], [1, 2, 3, 4, 1, 2, 9]]
    for step in range(2):
        drafter.begin_step(step)
        for i, target in enumerate(responses):
            drive(drafter, RolloutKey("p", i), target, step=step)
    copy = pickle.loads(pickle.dumps(drafter))  # plain Python state only: what the harness snapshots
    if hasattr(copy, "attach_policy"):  # a snapshot leaves the policy out; the replay attaches it again
        copy.attach_policy(drafter.attached_policy)
    for d in (drafter, copy):
        d.begin_step(2)
    for i, target in enumerate(responses):  # the copy drafts exactly what the original drafts
        assert drive(copy, RolloutKey("p", i), target, step=2) == drive(drafter, RolloutKey("p", i), target, step=2)


def test_every_drafter_has_flat_numeric_stats():
    for drafter in (PrefixReuseDrafter(), TreeCacheDrafter(), HistorySpecDrafter(),
                    SuffixGlobalDrafter(), HybridDrafter(), DASDrafter(), SeerDrafter()):
        stats = drafter.stats()
        assert stats and all(isinstance(v, (int, float)) for v in stats.values())
        assert "cache_bytes" in stats


def test_propose_before_start_is_harmless():
    for drafter in (PrefixReuseDrafter(), TreeCacheDrafter(), HistorySpecDrafter(),
                    SuffixGlobalDrafter(), HybridDrafter(), DASDrafter(), SeerDrafter()):
        assert drafter.propose(P0, [1, 2], 8) == Draft()
        drafter.observe(P0, [1, 2])


def test_methods_never_import_an_engine():
    banned = {"torch", "transformers", "vllm", "sglang"}
    for path in (ROOT / "methods").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not {n.split(".")[0] for n in names} & banned, f"{path.name} imports {names}"


# ----- the native backend (arctic-inference's suffix tree, where installed) -----

def _native_or_skip():
    from methods.suffix.tree import native_available
    if not native_available():
        pytest.skip("the optional native suffix tree is not installed")


NATIVE_CONFIGS = [p for p in CONFIGS if "backend" in OmegaConf.load(p).drafter]


def _native_cfg(path):
    """The config on the native backend; the longest-match rule (no native form) as best score."""
    cfg = OmegaConf.load(path).drafter
    cfg.backend = "native"
    if cfg.get("match") == "longest":
        cfg.match = "best"
    return cfg


def test_every_tree_config_has_the_backend_knob():
    assert {p.stem for p in NATIVE_CONFIGS} == {"tree_cache", "tree_cache_tree", "tree_cache_runahead",
                                                "das", "seer", "suffix_global", "hybrid", "history_spec"}
    for path in NATIVE_CONFIGS:
        assert OmegaConf.load(path).drafter.backend == "auto"


@pytest.mark.parametrize("path", NATIVE_CONFIGS, ids=lambda p: p.stem)
def test_native_drafter_state_pickles_and_resumes_identically(path):
    import pickle
    _native_or_skip()
    drafter = instantiate(_native_cfg(path))
    assert drafter.backend == "native"
    import random
    rng = random.Random(1)
    phrases = [[rng.randrange(7) for _ in range(4)] for _ in range(5)]
    responses = [sum((rng.choice(phrases) for _ in range(6)), []) for _ in range(6)]
    for step in range(3):
        drafter.begin_step(step)
        for i, target in enumerate(responses):
            drive(drafter, RolloutKey(f"p{i % 2}", i), target, step=step)
    copy = pickle.loads(pickle.dumps(drafter))  # the native trees travel as their call logs
    for d in (drafter, copy):
        d.begin_step(3)
    for i, target in enumerate(responses):  # ties included: the replayed trees are the same trees
        assert (drive(copy, RolloutKey(f"p{i % 2}", i), target, step=3)
                == drive(drafter, RolloutKey(f"p{i % 2}", i), target, step=3))
    assert copy.stats() == drafter.stats()


def _tie_path(drafter, key, tokens):
    """True if ``tokens`` follow, from one of the row's own suffix matches in the Python trie,
    a child of the highest count at every node: a draft that differs only through equal counts."""
    trie = drafter._tries[key.prompt_id]
    for node in trie.own_matches(drafter._live[key]):
        for token in tokens:
            child = trie.children(node).get(token)
            if child is None or trie.count_of(child) != trie.count_of(trie.top_child(node)):
                break
            node = child
        else:
            return True
    return False


@pytest.mark.parametrize("name", ["tree_cache", "tree_cache_tree", "das", "seer", "suffix_global", "hybrid"])
def test_native_and_python_backends_draft_alike(name):
    """The same calls on both backends: drafts agree except through equal-count ties (rare on a
    large vocabulary; DAS counts each fresh rollout twice and trees take every equal sibling, so
    those two tie more): every differing chain draft follows highest-count children."""
    import random
    _native_or_skip()
    path = ROOT / "conf" / "method" / f"{name}.yaml"
    native = instantiate(_native_cfg(path))
    python_cfg = _native_cfg(path)
    python_cfg.backend = "python"
    python = instantiate(python_cfg)
    rng = random.Random(3)
    phrases = [[rng.randrange(500) for _ in range(rng.randint(3, 8))] for _ in range(40)]
    weights = [1 / j for j in range(1, 11)]
    same = calls = 0
    for step in range(3):
        # phrases of unequal frequency (weights 1/j), so counts rarely tie
        targets = {RolloutKey(f"p{p}", i): sum(rng.choices(phrases[10 * p:10 * p + 10], weights, k=12), [])
                   for p in range(3) for i in range(4)}
        for d in (native, python):
            d.begin_step(step)
            for key in targets:
                d.start(key, [0, key.sample_idx])
        outputs = {key: [] for key in targets}
        while any(len(outputs[k]) < len(t) for k, t in targets.items()):
            live = [(k, len(outputs[k])) for k, t in targets.items() if len(outputs[k]) < len(t)]
            for d in (native, python):
                d.begin_iteration(live)
            for key, n in live:
                a = native.propose(key, list(outputs[key]), 24)
                b = python.propose(key, list(outputs[key]), 24)
                calls += 1
                same += a == b
                if a != b and name in ("tree_cache", "das", "hybrid"):
                    assert _tie_path(python.tree_cache if name == "hybrid" else python, key, a.token_ids)
                elif a != b and name == "tree_cache_tree":  # ties reorder a best-first tree, not its size
                    assert len(a) == len(b)
                new = targets[key][n:n + 1 + rng.randrange(3)]
                outputs[key] += new
                native.observe(key, new)
                python.observe(key, new)
        for key, t in targets.items():
            native.finish(key, rollout(key, t, step))
            python.finish(key, rollout(key, t, step))
    assert same >= (0.7 if name in ("das", "tree_cache_tree") else 0.95) * calls, f"only {same} of {calls} identical"


def _drive_lockstep(drafters, rng, phrases, weights, steps=3, prompts=3, samples=4, length=12):
    """The same engine calls on every drafter (a batch per step, ragged emissions, begin_iteration):
    the list of proposals of each."""
    drafts = [[] for _ in drafters]
    for step in range(steps):
        targets = {RolloutKey(f"p{p}", i): sum(rng.choices(phrases[10 * p:10 * p + 10], weights, k=length), [])
                   for p in range(prompts) for i in range(samples)}
        for d in drafters:
            d.begin_step(step)
            for key in targets:
                d.start(key, [0, key.sample_idx])
        outputs = {key: [] for key in targets}
        while any(len(outputs[k]) < len(t) for k, t in targets.items()):
            live = [(k, len(outputs[k])) for k, t in targets.items() if len(outputs[k]) < len(t)]
            for d in drafters:
                d.begin_iteration(live)
            for key, n in live:
                for d, out in zip(drafters, drafts):
                    out.append(d.propose(key, list(outputs[key]), 24))
                new = targets[key][n:n + 1 + rng.randrange(3)]
                outputs[key] += new
                for d in drafters:
                    d.observe(key, new)
            for key in [k for k, t in targets.items() if len(outputs[k]) >= len(t)]:
                target = targets.pop(key)
                for d in drafters:
                    d.finish(key, rollout(key, target, step))
    return drafts


@pytest.mark.parametrize("path", NATIVE_CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("match", [None, "best"])
@pytest.mark.parametrize("backend", ["python", "compiled"])
def test_index_drafts_equal_the_reference_trie(path, match, backend):
    """backend python (the suffix automaton) and compiled (the same in C) against backend trie
    (the depth-limited reference trie) on the same calls: every draft identical, ties included (a
    6-token vocabulary ties often), with each config's own rule and with match: best; DAS removes
    its recency copies."""
    import random
    from methods.suffix.compiled import compiled_available
    if backend == "compiled" and not compiled_available():
        pytest.skip("the compiled index was not built (no C compiler at install)")
    cfgs = []
    for backend in (backend, "trie"):
        cfg = OmegaConf.load(path).drafter
        cfg.backend = backend
        if match is not None and "match" in cfg:
            cfg.match = match
        cfgs.append(cfg)
    if match is not None and "match" not in cfgs[0]:
        pytest.skip("no match knob")
    python, trie = (instantiate(c) for c in cfgs)
    assert python.backend == cfgs[0].backend and trie.backend == "trie"
    rng = random.Random(5)
    phrases = [[rng.randrange(6) for _ in range(rng.randint(2, 6))] for _ in range(30)]
    a, b = _drive_lockstep([python, trie], rng, phrases, [1.0] * 10, steps=4)
    assert len(a) > 200 and sum(bool(d.token_ids) for d in a) > 50
    assert a == b


def test_history_spec_native_first_hit_drafts_like_python():
    """history_spec on the native tree (forced single-length calls) against the Python index: the
    same drafts except through equal-count ties."""
    import random
    _native_or_skip()
    drafters = [HistorySpecDrafter(backend=b) for b in ("native", "python")]
    assert [d.backend for d in drafters] == ["native", "python"]
    rng = random.Random(9)
    phrases = [[rng.randrange(300) for _ in range(rng.randint(3, 8))] for _ in range(30)]
    a, b = _drive_lockstep(drafters, rng, phrases, [1 / j for j in range(1, 11)], steps=4)
    same = sum(x == y for x, y in zip(a, b))
    assert sum(bool(d.token_ids) for d in b) > 20
    assert same >= 0.95 * len(a), f"only {same} of {len(a)} identical"


def test_native_tree_methods_are_token_identical_to_baseline(tmp_path):
    """Every tree method on the native backend (match: best where the default rule is longest)
    emits the baseline's tokens in float64 on the tiny trace, and drafts."""
    _native_or_skip()
    from bench.harness.cli import CONF_DIR, run
    from bench.report.results import load_run
    from hydra import compose, initialize_config_dir
    from tests.test_replay import outputs
    tree = ["tree_cache", "tree_cache_tree", "seer", "hybrid", "das", "suffix_global", "history_spec"]
    overrides = [f"method.{m}.drafter.backend=native" for m in tree]
    overrides += [f"method.{m}.drafter.match=best" for m in ("tree_cache", "tree_cache_tree", "seer", "hybrid")]
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("bench", overrides=["trace=countdown_tiny", "progress=false", "plots=false",
                                          "method=[" + ",".join(["baseline", *tree]) + "]", *overrides,
                                          "engine.dtype=float64", "max_steps=4", f"results_root={tmp_path}"])
    run_dir = run(cfg)
    base = outputs(run_dir, "baseline")
    assert base
    for m in tree:
        assert outputs(run_dir, m) == base, f"{m} on the native backend is not token-identical to the baseline"
    steps = load_run(run_dir)[3]
    assert steps.groupby("method")["num_accepted_tokens"].sum().drop("baseline").min() > 0
