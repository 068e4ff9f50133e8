"""The loop's compiled row work (bench/spec/_rows.c) equals its Python reference on random passes:
the simulator's recorded verdicts (empty, chain and tree drafts, drafts past the recording's end)
and the scheduler's settle (stops, room, first tokens, recorded finish reasons, margins, counters)."""
from __future__ import annotations

import copy
import random

import pytest

from methods.base import Draft, RolloutKey
from methods.suffix.compiled import compiled_available

from bench.core.engine_protocol import Request
from bench.core.verdicts import Verdict
from bench.spec.compiled_rows import compiled_recorded_verdicts, compiled_rows_available, compiled_settle_rows
from bench.spec.policy import SpecPolicy
from bench.spec.recorded import Recorded, recorded_verdicts, recorded_verdicts_python
from bench.spec.scheduler import LiveRow, Scheduler

needs_build = pytest.mark.skipif(not compiled_rows_available(), reason="bench.spec._rows is not built")


def _fields(v: Verdict):
    return v.emitted, v.path, v.logprobs, v.margins


def _random_draft(rng: random.Random, rec: list[int], t: int) -> Draft:
    """A draft that follows the recording for a while (so some nodes are accepted), then guesses."""
    kind = rng.choice(["empty", "chain", "chain", "tree", "tuple"])
    k = rng.randint(1, 12)
    follow = rng.randint(0, k)
    ids = [rec[t + i] if t + i < len(rec) and i < follow else rng.randint(0, 6) for i in range(k)]
    if kind == "empty":
        return Draft()
    if kind == "tuple":  # a drafter may hand a tuple: the compiled call copies it
        return Draft(tuple(ids))
    if kind == "chain":
        return Draft(ids)
    parents = [-1] + [rng.randint(-1, i - 1) for i in range(1, k)]
    return Draft(ids, parents)


def _random_pass(rng: random.Random, rows: int):
    recs, out_lens, drafts = [], [], []
    for i in range(rows):
        n = rng.randint(0, 30)
        toks = [rng.randint(0, 6) for _ in range(n)]  # few token ids: matches and duplicate siblings
        recs.append(Recorded(RolloutKey("p", i), toks, [rng.random() for _ in range(n)], 0.0, "stop"))
        t = rng.randint(0, n)
        out_lens.append(t)
        drafts.append(_random_draft(rng, toks, t))
    return recs, out_lens, drafts


@needs_build
def test_compiled_recorded_verdicts_equal_the_python_reference():
    rng = random.Random(7)
    for _ in range(300):
        recs, out_lens, drafts = _random_pass(rng, rng.randint(1, 9))
        got = compiled_recorded_verdicts(Verdict, recs, out_lens, drafts)
        want = recorded_verdicts_python(recs, out_lens, drafts)
        assert [_fields(v) for v in got] == [_fields(v) for v in want]
        assert all(type(v) is Verdict for v in got)
    assert recorded_verdicts is not recorded_verdicts_python  # the dispatcher
    recs, out_lens, drafts = _random_pass(rng, 5)
    assert [_fields(v) for v in recorded_verdicts(tuple(recs), tuple(out_lens), tuple(drafts))] == \
        [_fields(v) for v in recorded_verdicts_python(recs, out_lens, drafts)]


@needs_build
def test_compiled_recorded_verdicts_refuse_an_output_past_the_recording():
    rec = Recorded(RolloutKey("p", 0), [1, 2], [0.0, 0.0], 0.0, "stop")
    with pytest.raises(ValueError, match="output length 3 outside the recorded 2 tokens"):
        compiled_recorded_verdicts(Verdict, [rec], [3], [Draft()])


def _random_rows(rng: random.Random, m: int):
    rows, verdicts, draft_lens = [], [], []
    for i in range(m):
        row = LiveRow(Request(RolloutKey("p", i), [1, 2]), i, [rng.randint(0, 6)], rng.randint(1, 40),
                      cached=rng.randint(0, 9), final_reason=rng.choice(["", "", "length", "stop"]))
        row.output = [rng.randint(0, 6) for _ in range(rng.randint(0, min(row.limit, 10)) if rng.random() < 0.8 else 0)]
        row.logprobs = [rng.random() for _ in row.output]
        row.margins = list(row.logprobs) if rng.random() < 0.5 else []
        row.counters.num_accepted_tokens_per_pos = [rng.randint(0, 3) for _ in range(rng.randint(0, 4))]
        k = rng.choice([0, 0, rng.randint(1, 10)])
        acc = rng.randint(0, k)
        emitted = [rng.randint(0, 6) for _ in range(acc + rng.randint(0, 1))]
        path = list(range(acc + 1))
        lps = [rng.random() for _ in emitted]
        verdicts.append(Verdict(emitted, path, lps, [x - 0.5 for x in lps] if row.margins else []))
        draft_lens.append(k)
        rows.append(row)
    return rows, draft_lens, verdicts


def _state(row: LiveRow):
    c = row.counters
    return (row.pending, row.cached, row.output, row.logprobs, row.margins, row.first_t, row.last_t,
            row.finish_reason, c.num_forward_passes, c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
            c.num_accepted_tokens_per_pos)


@needs_build
def test_compiled_settle_equals_the_python_reference():
    rng = random.Random(11)
    scheduler = Scheduler(backend=None, policy=SpecPolicy())
    for trial in range(400):
        rows, draft_lens, verdicts = _random_rows(rng, rng.randint(1, 8))
        stops = rng.choice([set(), {2}, {0, 5}, frozenset({3})])
        now = rng.random()
        twin, twin_verdicts = copy.deepcopy(rows), copy.deepcopy(verdicts)
        got = compiled_settle_rows(rows, draft_lens, verdicts, stops, now)
        want = scheduler._settle_all_python(twin, [Draft()] * len(twin), draft_lens, twin_verdicts, stops, now,
                                            records=False)
        assert got == want, trial
        assert [_state(r) for r in rows] == [_state(r) for r in twin], trial
    # the dispatcher calls the compiled form when nothing is recorded
    rows, draft_lens, verdicts = _random_rows(rng, 6)
    twin, twin_verdicts = copy.deepcopy(rows), copy.deepcopy(verdicts)
    assert scheduler._settle_all(rows, [Draft()] * 6, draft_lens, verdicts, {2}, 1, records=False) == \
        scheduler._settle_all_python(twin, [Draft()] * 6, draft_lens, twin_verdicts, {2}, 1, records=False)
    assert [_state(r) for r in rows] == [_state(r) for r in twin]


@needs_build
def test_compiled_settle_names_a_bad_argument():
    rows, draft_lens, verdicts = _random_rows(random.Random(0), 2)
    with pytest.raises(TypeError, match="stops must be a set"):
        compiled_settle_rows(rows, draft_lens, verdicts, [2], 0.0)
    with pytest.raises(ValueError, match="differ in length"):
        compiled_settle_rows(rows, draft_lens[:1], verdicts, set(), 0.0)
    rows[0].logprobs = tuple(rows[0].logprobs)  # settled in place: a row's lists must be lists
    with pytest.raises(TypeError, match="must be lists"):
        compiled_settle_rows(rows[:1], draft_lens[:1], verdicts[:1], set(), 0.0)
    rec = Recorded(RolloutKey("p", 0), [1, 2], [0.0, 0.0], 0.0, "stop")
    with pytest.raises(TypeError, match="cannot be instantiated"):
        compiled_recorded_verdicts(type(iter([])), [rec], [0], [Draft()])


def test_the_loop_is_compiled_wherever_the_drafters_are():
    """Both extensions come from one install (setup.py): one without the other is a stale build."""
    assert compiled_rows_available() == compiled_available()
