"""The simulator's backend: "verification" reads the recorded rollout, so the scheduler drives a
drafter over a real run's log with no model and the same schedule as the engine.

    python -m bench.harness.simulate TRACE_DIR --method tree_cache          # uses it
    pytest tests/test_simulate.py -k engine                          # simulator == torch_ref

Under coupled sampling the exact rule accepts a draft token exactly when it equals the coupled
sample at its position, and a recorded baseline rollout *is* those samples: the accepted path is
the deepest draft path whose tokens equal the recorded continuation, then one more recorded
token (the bonus), cut at the end of the recorded rollout. For a probability-free draft this is
exact, whatever drafted it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from methods.base import Draft, Drafter, Rollout, RolloutKey

from bench.core.engine_protocol import Request
from bench.core.coupling import SamplingConfig
from bench.core.verdicts import Verdict, VerifyConfig, descend, node_depths
from bench.spec.compiled_rows import compiled_recorded_verdicts
from bench.spec.scheduler import LiveRow, PassResult


@dataclass
class Recorded:
    """One recorded rollout: its tokens (cut at max_new_tokens), their logprobs, reward, finish reason."""

    key: RolloutKey
    tokens: list[int]
    logprobs: list[float]
    reward: float
    finish_reason: str


_ROOT, _NO_MARGINS = (0,), ()  # shared by every verdict (a verdict's path and margins are only read)


def recorded_verdict(rec: Recorded, out_len: int, draft: Draft) -> Verdict:
    """What exact verification emits at output length ``out_len`` (the recorded tokens are the samples).

    Example: recorded [5, 6, 9, 2], out_len 0, draft [5, 6, 7] -> emitted [5, 6, 9], path (0, 1, 2).
    """
    return recorded_verdicts((rec,), (out_len,), (draft,))[0]


def recorded_verdicts(recs: Sequence[Recorded], out_lens: Sequence[int], drafts: Sequence[Draft]) -> list[Verdict]:
    """:func:`recorded_verdict` for every row of a pass, in one call (the simulator's hot path):
    compiled (``bench.spec.compiled_rows``) where it is built, else :func:`recorded_verdicts_python`."""
    if compiled_recorded_verdicts is not None:
        return compiled_recorded_verdicts(Verdict, list(recs), list(out_lens), list(drafts))
    return recorded_verdicts_python(recs, out_lens, drafts)


def recorded_verdicts_python(recs: Sequence[Recorded], out_lens: Sequence[int],
                             drafts: Sequence[Draft]) -> list[Verdict]:
    """The reference of :func:`recorded_verdicts`, in one loop (the compiled form equals it)."""
    verdicts = []
    keep = verdicts.append
    for rec, t, draft in zip(recs, out_lens, drafts):
        toks, ids = rec.tokens, draft.token_ids
        if not ids:  # nothing drafted: the next recorded token
            keep(Verdict(toks[t:t + 1], _ROOT, rec.logprobs[t:t + 1], _NO_MARGINS))
            continue
        if draft.parents is None:  # a chain: the accepted nodes are its longest prefix equal to the recording
            a, k = 0, min(len(ids), len(toks) - t)
            while a < k and ids[a] == toks[t + a]:
                a += 1
            path = tuple(range(a + 1))
        else:
            n = len(toks)
            _, path = descend([toks[t + d] if t + d < n else -1 for d in node_depths(draft)], draft)
        emitted = toks[t:t + len(path)]  # accepted + bonus, cut at the end of the recorded rollout
        keep(Verdict(emitted, path, rec.logprobs[t:t + len(emitted)], _NO_MARGINS))
    return verdicts


class RecordedBackend:
    """Verifies against ``recorded[key]``; a pass costs nothing (the scheduler's ``prices`` price it)."""

    def __init__(self, recorded: Mapping[RolloutKey, Recorded]):
        self.recorded = recorded

    def stops(self, sampling: SamplingConfig) -> set[int]:
        return set()  # a recorded rollout ends where it ended: its length is the row's limit

    def fits(self, request: Request, sampling: SamplingConfig) -> bool:
        return True

    def start_call(self, sampling: SamplingConfig) -> None:
        pass

    def admit(self, rows: list[LiveRow], sampling: SamplingConfig) -> None:
        for row in rows:
            rec = self.recorded[row.request.key]
            row.state, row.limit, row.final_reason = rec, len(rec.tokens), rec.finish_reason

    def forward(self, rows: list[LiveRow], group: list[int], drafts: list[Draft], sampling: SamplingConfig,
                verify: VerifyConfig) -> PassResult:
        grouped = rows if len(group) == len(rows) else [rows[i] for i in group]  # one group (most passes): all rows
        return PassResult(recorded_verdicts([row.state for row in grouped], [len(row.output) for row in grouped], drafts),
                          0.0, 0.0)

    def commit(self, rows: list[LiveRow], verdicts: list[Verdict]) -> None:
        pass

    def release(self, keep: list[int], rows: list[LiveRow]) -> None:
        pass


def recorded_rows(df, max_new_tokens: int, cut: bool = True) -> list[Recorded]:
    """A step's recorded rollouts (a DataFrame: prompt_id, sample_idx, token_ids and optionally
    logprobs, reward, finish_reason), each cut at ``max_new_tokens`` unless ``cut`` is False."""
    has_lp, has_rew, has_fr = "logprobs" in df, "reward" in df, "finish_reason" in df
    rows = []
    for i, (pid, idx, toks) in enumerate(zip(df["prompt_id"], df["sample_idx"], df["token_ids"])):
        rec = [int(t) for t in toks][:max_new_tokens] if cut else [int(t) for t in toks]
        lp = [float(x) for x in df["logprobs"].iat[i]][:len(rec)] if has_lp and df["logprobs"].iat[i] is not None else []
        if len(lp) != len(rec):
            lp = [0.0] * len(rec)  # only the ratio rule reads logprobs, and it is refused
        fr = str(df["finish_reason"].iat[i]) if has_fr else ("length" if len(rec) >= max_new_tokens else "stop")
        rows.append(Recorded(RolloutKey(str(pid), int(idx)), rec, lp,
                             float(df["reward"].iat[i]) if has_rew else float("nan"), fr))
    return rows


def feed_finished(drafter: Drafter, step: int, recorded: list[Recorded], prompts: Mapping[str, list[int]]) -> None:
    """Show ``drafter`` a step that is not replayed (a sparse trace's rollouts-only step) as finished
    rollouts, with the calls an engine makes, in a fixed order: ``begin_step``, ``start`` for every
    rollout in file order, then ``observe`` (the whole response at once) and ``finish`` in finish
    order (shortest first, ties in file order: a one-token-per-pass engine's). The replay and the
    simulator both feed history through this, so their caches hold the same history. A drafter
    with a ``begin_history_step`` hook gets that instead of ``begin_step`` (a learned drafter trains
    before the steps it drafts, not before steps it is only shown)."""
    getattr(drafter, "begin_history_step", drafter.begin_step)(step)
    for r in recorded:
        drafter.start(r.key, prompts.get(r.key.prompt_id, ()))
    for _, r in sorted(enumerate(recorded), key=lambda ir: (len(ir[1].tokens), ir[0])):
        drafter.observe(r.key, r.tokens)
        drafter.finish(r.key, Rollout(key=r.key, step=step, prompt_token_ids=list(prompts.get(r.key.prompt_id, ())),
                                      token_ids=list(r.tokens), logprobs=list(r.logprobs),
                                      finish_reason=r.finish_reason))
