"""A drafter's batch calls (``propose_batch`` / ``observe_batch``) equal its per-row calls in order.

The scheduler asks every row of an iteration through the batch forms; the tree drafters answer
them in one compiled call. These tests drive two copies of each drafter through the same random
GRPO-like steps, one through the batch forms and one row by row, and compare every draft and
the final stats; and they check the rule that keeps a subclass's per-row override in force.
"""
from __future__ import annotations

import copy
import dataclasses
import pickle
import random

import pytest

from bench.core.drafting import next_draft, next_drafts, observe_all
from methods.base import Draft, NullDrafter, Rollout, RolloutKey
from methods.das import DASDrafter
from methods.history_spec import HistorySpecDrafter
from methods.hybrid import HybridDrafter
from methods.prefix_reuse import PrefixReuseDrafter
from methods.seer import SeerDrafter
from methods.suffix.compiled import compiled_available
from methods.suffix_global import SuffixGlobalDrafter
from methods.tree_cache import TreeCacheDrafter

MAKERS = {
    "tree_cache": lambda: TreeCacheDrafter(max_depth=8, max_spec_tokens=6),
    "tree_cache_best_tree": lambda: TreeCacheDrafter(max_depth=8, max_spec_tokens=6, match="best", tree=True,
                                                     backend="compiled" if compiled_available() else "python"),
    "tree_cache_python": lambda: TreeCacheDrafter(max_depth=8, max_spec_tokens=6, backend="python"),
    "history_only": lambda: TreeCacheDrafter(max_depth=8, max_spec_tokens=6, in_flight=False),
    "das": lambda: DASDrafter(max_depth=8, max_spec_tokens=6),
    "seer": lambda: SeerDrafter(max_depth=8, max_spec_tokens=6),
    "seer_small_pool": lambda: SeerDrafter(max_depth=8, max_spec_tokens=6, max_batch_draft_tokens=7),
    "seer_no_pool": lambda: SeerDrafter(max_depth=8, max_spec_tokens=6, max_batch_draft_tokens=None),
    "history_spec": lambda: HistorySpecDrafter(),
    "suffix_global": lambda: SuffixGlobalDrafter(max_depth=8, max_spec_tokens=6),
    "suffix_global_tree": lambda: SuffixGlobalDrafter(max_depth=8, max_spec_tokens=6, tree=True, max_cached_responses=5),
    "suffix_global_history": lambda: SuffixGlobalDrafter(max_depth=8, max_spec_tokens=6, in_flight=False),
    "hybrid": lambda: HybridDrafter(max_depth=8, max_spec_tokens=6),
    "prefix_reuse": lambda: PrefixReuseDrafter(),
}


def _drive(drafter, batched: bool, seed: int, steps: int = 3, prompts: int = 3, samples: int = 3,
           length: int = 24, vocab: int = 4, max_new: int = 20) -> list:
    """Steps of ``prompts x samples`` rollouts over a small vocabulary (many repeats), all rows in
    one batch; each pass accepts a random prefix of the draft. Rows sometimes skip an observe (the
    engine showed tokens the drafter did not observe), which the drafters must top up."""
    rng = random.Random(seed)
    seen = []
    for step in range(steps):
        drafter.begin_step(step)
        keys = [RolloutKey(f"p{p}", s) for p in range(prompts) for s in range(samples)]
        targets = {k: [rng.randrange(vocab) for _ in range(rng.randrange(4, length))] for k in keys}
        outputs = {k: [] for k in keys}
        for k in keys:
            drafter.start(k, [7, int(k.prompt_id[1:])])
        live = list(keys)
        while live:
            outs = [outputs[k] for k in live]
            if rng.random() > 0.2:  # the engine reports the batch (Seer hands out its pool), or does not
                drafter.begin_iteration([(k, len(outputs[k])) for k in live], budget=rng.choice([None, 2, 6]))
            if batched:
                drafts = next_drafts(drafter, live, outs, max_new)
            else:
                drafts = [next_draft(drafter, k, o, max_new) for k, o in zip(live, outs)]
            seen.append([(list(d.token_ids), d.parents) for d in drafts])
            emitted = []
            for k, d in zip(live, drafts):
                t, out = targets[k], outputs[k]
                a = rng.randrange(len(d.token_ids) + 1)
                new = t[len(out):len(out) + a + 1]
                out += new
                emitted.append(new if rng.random() > 0.1 else [])  # a skipped observe
            if batched:
                observe_all(drafter, live, emitted)
            else:
                for k, e in zip(live, emitted):
                    drafter.observe(k, e)
            for k in list(live):
                if len(outputs[k]) >= min(len(targets[k]), max_new - 1):
                    live.remove(k)
                    drafter.finish(k, Rollout(k, step, [7], list(outputs[k]), [0.0] * len(outputs[k]), "stop"))
    return seen


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_calls_equal_the_per_row_calls(name, seed):
    batched, per_row = MAKERS[name](), MAKERS[name]()
    got, want = _drive(batched, True, seed), _drive(per_row, False, seed)
    assert got == want
    assert any(tokens for it in got for tokens, _ in it), "the scenario drafted nothing: it tests nothing"
    assert batched.stats() == per_row.stats()
    if name.startswith("seer"):  # the pool was handed out, and the small one ran dry
        stats = batched.stats()
        assert stats["iterations"] > 0 and (stats["allocated_tokens"] > 0) == (name != "seer_no_pool")
        assert (stats["starved_rows"] > 0) == (name == "seer_small_pool")


@pytest.mark.skipif(not compiled_available(), reason="the compiled extension is not built")
def test_the_fast_cases_run_on_the_compiled_tries():
    for name in ("tree_cache", "tree_cache_best_tree", "das", "seer", "suffix_global", "suffix_global_tree"):
        assert MAKERS[name]().backend == "compiled", name  # else they test the per-row fallback only
    assert MAKERS["hybrid"]().tree_cache.backend == "compiled"


def test_a_rollout_key_keeps_its_hash_out_of_pickles():
    key = RolloutKey("p", 3)
    table = {key: 1}
    blob = pickle.dumps(key)
    assert b"_hash" not in blob  # a string's hash differs between processes
    back = pickle.loads(blob)
    assert back == key and hash(back) == hash(key) == hash(("p", 3)) and table[back] == 1
    assert copy.deepcopy(key) == key and dataclasses.asdict(key) == {"prompt_id": "p", "sample_idx": 3}


def test_a_subclass_that_overrides_propose_gets_the_per_row_batch_form_back():
    class Capped(TreeCacheDrafter):
        def propose(self, key, output, budget):
            return super().propose(key, output, min(budget, 1))

        def observe(self, key, new_tokens):
            super().observe(key, list(new_tokens)[:1])

    assert Capped.propose_batch is NullDrafter.propose_batch
    assert Capped.observe_batch is NullDrafter.observe_batch
    assert SeerDrafter.propose_batch is not NullDrafter.propose_batch  # Seer's starved rows cost a lookup
    assert SeerDrafter.observe_batch is TreeCacheDrafter.observe_batch  # and observes as the tree cache does
    assert DASDrafter.propose_batch is not NullDrafter.propose_batch  # DAS has a batch form of its own


def test_next_drafts_asks_only_rows_with_room_and_cuts_to_each_budget():
    class Asked(NullDrafter):
        def __init__(self):
            self.calls = []

        def propose(self, key, output, budget):
            self.calls.append((key, budget))
            return Draft([1] * 9)

    d = Asked()
    keys = [RolloutKey("p", i) for i in range(3)]
    drafts = next_drafts(d, keys, [[0] * 4, [0] * 7, [0] * 2], 8)  # room 4, 1, 6: budgets 3, 0, 5
    assert d.calls == [(keys[0], 3), (keys[2], 5)]
    assert [len(x) for x in drafts] == [3, 0, 5]


def test_a_drafter_without_batch_forms_is_called_row_by_row():
    class Plain:  # the Drafter protocol, no NullDrafter
        def __init__(self):
            self.calls = []

        def propose(self, key, output, budget):
            self.calls.append(("propose", key.sample_idx))
            return Draft()

        def observe(self, key, new_tokens):
            self.calls.append(("observe", key.sample_idx))

    d = Plain()
    keys = [RolloutKey("p", i) for i in range(2)]
    next_drafts(d, keys, [[], []], 8)
    observe_all(d, keys, [[1], [2]])
    assert d.calls == [("propose", 0), ("propose", 1), ("observe", 0), ("observe", 1)]


@pytest.mark.skipif(not compiled_available(), reason="the compiled extension is not built")
def test_the_compiled_batch_call_on_each_kind_of_row():
    from methods.suffix.compiled import CompiledIndex, speculate_own_many
    trie = CompiledIndex(8)
    for seq, text in enumerate(([-1, 1, 2, 1, 2, 1], [-1, 1, 2])):
        trie.extend(seq, text)
    one = trie.speculate_own(0, True, 5)
    rows = ([trie, trie, trie, trie, None, trie], [0, 1, 0, 0, 0, None],
            [[1, 2, 1, 2, 1], [1, 2, 1], [1, 2, 1, 2], [1, 2, 1, 2, 1], [], []], [5, 5, 5, 0, 5, 5])
    results, drafts, tokens, _ = speculate_own_many(*rows, 6, True, 1.0, 0.0, 0.1, False)
    assert results[0] == (one.token_ids, None) and one.token_ids  # in step: the per-row draft
    assert trie.sequence(1) == [-1, 1, 2, 1]  # behind: topped up from its output, then drafted
    assert results[1] == (trie.speculate_own(1, True, 5).token_ids, None)
    assert results[2:] == [([], None)] * 4  # ahead of its output, limit 0, no trie, no sequence id
    assert drafts == sum(bool(t) for t, _ in results) and tokens == sum(len(t) for t, _ in results)
    with pytest.raises(ValueError, match="differ in length"):
        speculate_own_many([trie], [0, 1], [[]], [1], 6, True, 1.0, 0.0, 0.1, False)
