"""The learned drafter (bench/drafters/learned.py): its training schedule, its batched drafts, and
the stale-drafter guard catching an injected weight-sync fault. Identity with the baseline on
torch_ref in float64 is tests/test_replay.py's (draft_lm is one of its exact methods)."""
from __future__ import annotations

import random

import pytest

from bench.drafters.learned import DraftLMDrafter
from bench.spec.recorded import Recorded, feed_finished
from methods.base import Rollout, RolloutKey

PROMPTS = {f"p{i}": [1, 2 + i] for i in range(4)}


def _responses(step: int, rng: random.Random) -> list[Recorded]:
    """Each prompt answers with its own repeating phrase, a few tokens changed per step."""
    out = []
    for i, pid in enumerate(PROMPTS):
        phrase = [10 + i, 20 + i, 30 + i, 40 + i, 50 + i]
        for s in range(2):
            tokens = (phrase * 8)[:36]
            for _ in range(2):
                tokens[rng.randrange(len(tokens))] = 60 + rng.randrange(8)
            out.append(Recorded(RolloutKey(pid, s), tokens, [0.0] * len(tokens), 0.0, "stop"))
    return out


def _drive_step(d: DraftLMDrafter, step: int, recorded: list[Recorded], fault: str | None = None) -> None:
    """A drafted step, verified against the recorded rollouts (all rows live until they end); ``fault`` is injected after the step's training, as a broken weight sync would leave it."""
    d.begin_step(step)
    if fault:
        d.inject_fault(fault)
    d.reset_stats()
    for r in recorded:
        d.start(r.key, PROMPTS[r.key.prompt_id])
    pos = {r.key: 0 for r in recorded}
    while any(pos[r.key] < len(r.tokens) for r in recorded):
        live = [r for r in recorded if pos[r.key] < len(r.tokens)]
        d.begin_iteration([(r.key, pos[r.key]) for r in live])
        for r in live:  # exact verification against the recorded tokens: the matching prefix, then one more
            p = pos[r.key]
            draft = d.propose(r.key, r.tokens[:p], len(r.tokens) - p).token_ids
            a = next((j for j, t in enumerate(draft) if t != r.tokens[p + j]), len(draft))
            d.observe(r.key, r.tokens[p:p + a + 1])
            pos[r.key] = p + a + 1
    for r in recorded:
        d.finish(r.key, Rollout(r.key, step, PROMPTS[r.key.prompt_id], r.tokens, r.logprobs, "stop"))


def _small(**kw) -> DraftLMDrafter:
    return DraftLMDrafter(**{"hidden": 32, "heads": 2, "layers": 1, "window": 8, "warmup_steps": 80,
                             "update_steps": 5, "batch_windows": 16, "lr": 1e-2, **kw})


def test_history_steps_train_nothing_the_first_drafted_step_warms_up_then_updates_follow_the_period():
    rng = random.Random(0)
    d = _small(update_every=2)
    for step in range(3):  # shown as history only: recorded, not trained
        feed_finished(d, step, _responses(step, rng), PROMPTS)
    assert d.lm is None
    kinds = []
    for step in range(3, 8):
        _drive_step(d, step, _responses(step, rng))
        s = d.stats()
        kinds.append((s["warmups"], s["updates"]))
    assert kinds == [(1, 0), (0, 0), (0, 1), (0, 0), (0, 1)]  # warm-up at 3, updates at 5 and 7


def test_a_frozen_drafter_never_updates_and_lag_holds_back_the_newest_steps():
    rng = random.Random(0)
    frozen = _small(update_every=0)
    for step in range(2):
        feed_finished(frozen, step, _responses(step, rng), PROMPTS)
    for step in range(2, 5):
        _drive_step(frozen, step, _responses(step, rng))
        assert frozen.stats()["updates"] == 0
    lagged = _small(lag=2)
    feed_finished(lagged, 0, _responses(0, rng), PROMPTS)
    lagged.begin_step(1)  # step 0 is held back by the lag of 2: nothing to train on yet
    assert lagged.lm is None
    feed_finished(lagged, 1, _responses(1, rng), PROMPTS)
    feed_finished(lagged, 2, _responses(2, rng), PROMPTS)
    lagged.begin_step(3)  # steps 0 only (3 - 2 = 1 > 0)
    assert lagged.lm is not None and lagged.stats()["warmups"] == 1


def test_the_trained_drafter_drafts_the_run_and_one_batched_call_equals_row_by_row_calls():
    rng = random.Random(0)
    d = _small()
    for step in range(3):
        feed_finished(d, step, _responses(step, rng), PROMPTS)
    _drive_step(d, 3, _responses(3, rng))
    s = d.stats()
    assert s["warmups"] == 1 and s["draft_tokens"] > 0 and s["acceptance"] > 0.5, s
    contexts = [PROMPTS["p0"] + [10, 20, 30], PROMPTS["p1"] + [11, 21, 31, 41, 51, 11, 21]]
    together = d.lm.propose(contexts, 4)
    alone = [d.lm.propose([c], 4)[0] for c in contexts]
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert together[0][0][:2] == [40, 50]  # it learnt the phrase


@pytest.mark.parametrize("fault", ["corrupt", "reset"])
def test_the_stale_drafter_guard_flags_an_injected_fault_and_nothing_before_it(fault):
    rng = random.Random(1)
    d = _small()
    for step in range(2):
        feed_finished(d, step, _responses(step, rng), PROMPTS)
    flags, rates = [], []
    for step in range(2, 8):
        _drive_step(d, step, _responses(step, rng), fault if step == 6 else None)
        s = d.stats()
        flags.append(s["stale"])
        rates.append(round(s["acceptance"], 2))
    # healthy steps pass; the fault is flagged from its step on (5 update steps do not undo it)
    assert flags == [0, 0, 0, 0, 1, 1] and min(rates[:4]) > 0.5, (flags, rates)
    with pytest.raises(ValueError, match="known faults"):
        d.inject_fault("typo")


@pytest.mark.parametrize("order, min_prob", [("tree_first", 0.3), ("learned_first", 0.3), ("learned_first", 1.0)])
def test_learned_tree_drafts_with_the_part_its_order_picks_and_counts_which(order, min_prob):
    from bench.drafters.learned_tree import LearnedTreeDrafter
    rng = random.Random(2)
    d = LearnedTreeDrafter(order=order, learned_min_prob=min_prob)
    d.learned = _small(update_steps=5)  # the small draft model of the other tests
    d._parts = (d.tree_cache, d.learned)
    for step in range(2):
        feed_finished(d, step, _responses(step, rng), PROMPTS)
    _drive_step(d, 2, _responses(2, rng))
    s = d.stats()
    assert s["learned_warmups"] == 1 and s["stale"] == 0
    if order == "tree_first":  # long tree drafts where the phrase repeats, the draft model where the tree is short
        assert s["drafts_by_tree"] > 0 and s["drafts_by_learned"] > 0, s
    elif min_prob < 1:  # a trained model on a repeating phrase is confident: it drafts
        assert s["drafts_by_learned"] > 0, s
    else:  # never confident enough: the tree drafts everything, and the draft model's counters stay empty
        assert s["drafts_by_learned"] == 0 and s["drafts_by_tree"] > 0 and s["learned_draft_tokens"] == 0, s
    with pytest.raises(ValueError, match="tree_first"):
        LearnedTreeDrafter(order="both")


def test_the_results_table_notes_a_stale_drafter_by_method_and_step():
    import pandas as pd

    from bench.report.collect import stale_drafter_notes
    steps = pd.DataFrame({"method": ["draft_lm", "draft_lm", "tree_cache", "learned_tree"], "step": [3, 4, 4, 4],
                          "drafter_stale": [0.0, 1.0, None, 0.0]})
    notes = stale_drafter_notes(steps)
    assert len(notes) == 1 and "draft_lm" in notes[0] and "[4]" in notes[0]
    assert stale_drafter_notes(steps.drop(columns="drafter_stale")) == []


def test_idle_seconds_are_each_iterations_seconds_times_the_share_of_the_first_batch_gone():
    import pandas as pd

    from bench.benchmarks.train_idle import idle_seconds
    it = pd.DataFrame({"method": ["baseline"] * 3, "step": [5] * 3, "iteration": [0, 1, 2],
                       "live_rows": [4, 2, 1], "forward_s": [1.0, 1.0, 0.5], "verify_s": [0.0, 0.5, 0.0],
                       "drafter_s": [0.0] * 3, "other_s": [0.0, 0.5, 0.5]})
    row = idle_seconds(it).iloc[0]
    assert row["seconds"] == pytest.approx(4.0)
    assert row["idle_s"] == pytest.approx(0 + 2.0 * 0.5 + 1.0 * 0.75)
