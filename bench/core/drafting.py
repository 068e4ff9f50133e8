"""What every generation loop does around a drafter, written once: report the live batch, ask for a
draft that fits the remaining length, cut what a verification emitted at the first stop token and
at the room left (:func:`settle`), and count drafts and accepted tokens the way vLLM's spec-decode
counters do (:class:`DraftCounters`).

Used by the torch reference engine, the model-free simulator, the vLLM adapter and its proposer,
and the SGLang adapter, so their counters mean the same thing by construction
(``pytest tests/test_drafting.py tests/test_simulate.py``). :func:`drafter_mode` says which
engine configuration a method needs (a method that never drafts runs on an engine with no
speculative config).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, NamedTuple, Sequence

from methods.base import Draft, NO_DRAFT, Drafter, RolloutKey


def report_live(drafter: Drafter, live: Sequence[tuple[RolloutKey, int]], budget: int | None = None) -> None:
    """Tell the drafter the live batch of this iteration, [(key, output length), ...] in batch
    order, and the policy's cap, before any of its proposals (the optional ``begin_iteration``
    hook, methods/base.py)."""
    hook = getattr(drafter, "begin_iteration", None)
    if hook is not None:
        hook(live, budget=budget)


def tell_verified(drafter: Drafter, key: RolloutKey, draft_len: int) -> None:
    """Tell the drafter that only ``draft_len`` nodes of its last proposal for ``key`` are verified
    (the optional ``verified`` hook, methods/base.py)."""
    hook = getattr(drafter, "verified", None)
    if hook is not None:
        hook(key, draft_len)


def drafts_mode(drafter: Drafter) -> str:
    """What the drafter declares it drafts (``drafts``, methods/base.py): never, first or decoding.
    A drafter that declares nothing is taken to draft while decoding."""
    from methods.base import DRAFTS
    mode = getattr(drafter, "drafts", "decoding")
    if mode not in DRAFTS:
        raise ValueError(f"{type(drafter).__name__}.drafts is {mode!r}; declare one of {DRAFTS}")
    return mode


def refuse_feature_readers(drafter: Drafter, engine: str) -> None:
    """An engine that cannot hand the policy's hidden states to drafters refuses one that reads them
    (``reads_features``: the EAGLE-style head) by name, instead of letting it silently never draft."""
    if getattr(drafter, "reads_features", False):
        raise ValueError(f"{getattr(drafter, 'name', type(drafter).__name__)} drafts from the policy's hidden "
                         f"states, which {engine} does not hand to drafters: run it with engine=torch_ref")


def drafter_mode(drafter: Drafter) -> str:
    """The engine configuration a method needs, named as ``engine.plain_engine_for`` names them:
    'baseline' (never drafts), 'prefix' (one draft at output length 0 only: SPEC-RL's prefix reuse)
    or 'tree' (drafts while decoding, so the engine needs a speculative config)."""
    return {"never": "baseline", "first": "prefix", "decoding": "tree"}[drafts_mode(drafter)]


SCORING_LOGPROBS = ("top1", "draft", "full")


def scoring_logprobs(greedy: bool, rule: str, temperature: float) -> str:
    """What an engine's scoring request must return at each draft position (and at the position
    after the draft) for the suite's rule to decide exactly as ``bench.core.verify`` would:

    - ``top1`` (greedy decoding or rule greedy): the argmax and the draft token's logprob;
    - ``draft`` (rule ratio at temperature 1): the draft tokens' logprobs only, since the ratio
      test reads p(x) = softmax(logits)(x) of the draft token, and the token emitted at the first
      rejection (or the bonus) is a plain sample of the processed target, which the engine's own
      sampler draws (same distribution, not coupled to the suite's uniforms);
    - ``full`` (rule exact at temperature > 0, and ratio at a temperature other than 1): the whole
      distribution: the exact rule samples each node with its coupled uniform by inverse CDF (the
      mass below the draft token is needed, not just p(x)), and p(x) at temperature T needs the
      normaliser of logits / T, which raw logprobs of a few tokens do not give.
    """
    if greedy or rule == "greedy":
        return "top1"
    if rule == "ratio" and temperature == 1.0:
        return "draft"
    return "full"


def verify_from_logprobs(mode: str, draft: Draft, key64: int, lenience: float, out_len: int = 0,
                         top1: Sequence[tuple[int, float]] = (), draft_logprobs: Sequence[float] = (),
                         bonus: tuple[int, float] | None = None) -> tuple[list[int], int, list[float]]:
    """The suite's rule (``bench.core.verify.descend`` / ``ratio_accept``) on a chain draft from what a
    ``top1`` or ``draft`` scoring request returned (:func:`scoring_logprobs`); ``full`` goes
    through ``bench.core.verify.verify_batch`` instead.

    top1: (argmax token, its logprob) at local nodes 0..k (node k: the position after the draft).
    draft_logprobs: log p(x_i) of each draft token at temperature 1; bonus: (token, logprob) the
    engine sampled after the draft. Returns (emitted, accepted, logprobs); under ``draft`` a
    rejected draft emits only its accepted tokens (the engine's continuation samples the position
    of the rejection, a plain sample of the target as the rule says).

    Example: top1 [(5, -.1), (9, -.3), (4, -.2)] for draft [5, 6] -> ([5, 9], 1, [-.1, -.3]).
    """
    from bench.core.verify import descend, ratio_accept
    from bench.core.sampling import STREAM_ACCEPT, uniform_reference
    k = len(draft)
    if mode == "top1":
        emitted, path = descend([t for t, _ in top1], draft)
        return emitted, len(path) - 1, [float(top1[j][1]) for j in range(len(emitted))]
    if mode != "draft":
        raise ValueError(f"verify_from_logprobs reads top1 or draft scoring, not {mode!r}")
    accept_u = [uniform_reference(key64, out_len + i, STREAM_ACCEPT) for i in range(k)]
    sampled = [-1] * k + [bonus[0] if bonus is not None else -1]
    emitted, path = ratio_accept(draft, sampled, accept_u, list(draft_logprobs), lenience)
    accepted = len(path) - 1
    if emitted[-1] == -1:
        emitted = emitted[:-1]
    lps = [float(x) for x in draft_logprobs[:accepted]]
    if len(emitted) > accepted:
        lps.append(float(bonus[1]))
    return emitted, accepted, lps


def next_draft(drafter: Drafter, key: RolloutKey, output: Sequence[int], max_new_tokens: int) -> Draft:
    """The drafter's proposal cut to what can still be emitted: budget = remaining - 1, since a
    fully accepted draft is followed by one more sampled token (the bonus)."""
    budget = max_new_tokens - len(output) - 1
    if budget <= 0:
        return NO_DRAFT
    draft = drafter.propose(key, output, budget)
    if len(draft.token_ids) > budget:
        draft = draft.truncated(budget)
    if draft.parents is not None:
        draft.validate()
    return draft


def next_drafts(drafter: Drafter, keys: Sequence[RolloutKey], outputs: Sequence[Sequence[int]],
                max_new_tokens: int) -> list[Draft]:
    """:func:`next_draft` for every row of an iteration, in order, through the drafter's
    ``propose_batch`` (looked up on its type, so a wrapper's per-row calls stay its own) where it
    has one: rows with no room are not asked and get an empty draft."""
    batch = getattr(type(drafter), "propose_batch", None)
    if batch is None:
        return [next_draft(drafter, k, o, max_new_tokens) for k, o in zip(keys, outputs)]
    budgets = [max_new_tokens - len(o) - 1 for o in outputs]
    if min(budgets, default=1) > 0:
        drafts = batch(drafter, keys, outputs, budgets)
    else:  # some rows have no room: ask the others
        asked = [i for i, b in enumerate(budgets) if b > 0]
        drafts = [NO_DRAFT] * len(keys)
        for i, d in zip(asked, batch(drafter, [keys[i] for i in asked], [outputs[i] for i in asked],
                                     [budgets[i] for i in asked])):
            drafts[i] = d
    for i, (d, b) in enumerate(zip(drafts, budgets)):
        if len(d.token_ids) > b:
            drafts[i] = d = d.truncated(b)
        if d.parents is not None:
            d.validate()
    return drafts


def observe_all(drafter: Drafter, keys: Sequence[RolloutKey], new_tokens: Sequence[Sequence[int]]) -> None:
    """``observe`` every row's kept tokens, in order, through ``observe_batch`` where the drafter's
    type has one."""
    batch = getattr(type(drafter), "observe_batch", None)
    if batch is not None:
        batch(drafter, keys, new_tokens)
        return
    observe = drafter.observe
    for k, t in zip(keys, new_tokens):
        observe(k, t)


@dataclass(slots=True)
class DraftCounters:
    """Per-rollout counters (docs/results.md; names as vLLM's).

    ``num_forward_passes`` counts every model pass that emitted tokens to the rollout, a scoring
    pass included: on torch_ref a draft proposed at output length 0 is verified inside the prefill
    pass, on vLLM and SGLang by a scoring request of its own, which counts as that pass (it emits
    the accepted tokens and, where the rule fetched the distributions, the token after them).
    ``num_scoring_passes`` / ``num_scoring_tokens`` label what the separate scoring cost: requests
    and tokens (prompt + draft) fed to them; 0 on torch_ref, where the scoring is folded into the
    prefill. They are not Rollout fields (:meth:`as_dict` leaves them out); the adapters sum them
    per call in ``last_scoring``.
    """

    num_forward_passes: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_scoring_passes: int = 0
    num_scoring_tokens: int = 0

    def record(self, draft_len: int, accepted: int) -> None:
        """One verification of a draft of ``draft_len`` tokens, ``accepted`` of them emitted."""
        self.num_forward_passes += 1
        if not draft_len:
            return
        self.num_drafts += 1
        self.num_draft_tokens += draft_len
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < accepted:
            per_pos.extend([0] * (accepted - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1

    def record_scoring(self, tokens: int) -> None:
        """One separate scoring request over ``tokens`` tokens (prompt + draft); its verification
        is counted by :meth:`record` (via :func:`settle`) like any other pass."""
        self.num_scoring_passes += 1
        self.num_scoring_tokens += tokens

    def record_plain(self, tokens: int) -> None:
        """``tokens`` passes of plain decoding (one sampled token each, nothing drafted)."""
        self.num_forward_passes += tokens

    def add(self, other: "DraftCounters") -> None:
        """Add another phase's counters (e.g. what vLLM's proposer counted during generation)."""
        self.num_forward_passes += other.num_forward_passes
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos, theirs = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(theirs) - len(per_pos)))
        for i, n in enumerate(theirs):
            per_pos[i] += n
        self.num_scoring_passes += other.num_scoring_passes
        self.num_scoring_tokens += other.num_scoring_tokens

    def as_dict(self) -> dict:
        return {"num_forward_passes": self.num_forward_passes, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}


class Settled(NamedTuple):
    """What :func:`settle` kept of one verification: the first ``n`` emitted tokens, ``accepted``
    of them draft tokens; ``finish_reason`` is "stop", "length" or "" (the rollout goes on).
    A tuple: the scheduler settles every row of every pass (the simulator's hot path)."""

    n: int
    accepted: int
    finish_reason: str


def cut_emitted(emitted: Sequence[int], stops: Collection[int], room: int) -> int:
    """How many of one pass's emitted tokens a rollout keeps: through the first stop token, and
    at most ``room`` (max_new_tokens minus the output so far).

    Example: emitted [4, 2, 9] with stops {2}, room 8 -> 2; room 1 -> 1.
    """
    n = min(len(emitted), max(room, 0))
    if not stops:
        return n
    for i in range(n):
        if emitted[i] in stops:
            return i + 1
    return n


def settle(counters: DraftCounters, draft_len: int, emitted: Sequence[int], num_accepted: int,
           stops: Collection[int], out_len: int, max_new_tokens: int) -> Settled:
    """One verification of a row, the same on every engine: cut ``emitted`` (accepted draft tokens,
    then the sample at the first mismatch or the bonus) at the first stop token and at the room
    left, count the pass in ``counters`` with the accepted tokens that survive the cut, and say
    whether the row is done. ``out_len`` is the row's output length before these tokens.
    :func:`settle_many` on one row.

    Example: draft [5, 6, 2], emitted [5, 6, 2, 7] (3 accepted + the bonus), stops {2}
    -> Settled(3, 3, "stop"): the bonus after the stop token is dropped.
    """
    return settle_many((counters,), (draft_len,), (emitted,), (num_accepted,), stops, (out_len,),
                       (max_new_tokens,))[0]


def settle_many(counters: Sequence[DraftCounters], draft_lens: Sequence[int], emitted: Sequence[Sequence[int]],
                num_accepted: Sequence[int], stops: Collection[int], out_lens: Sequence[int],
                limits: Sequence[int]) -> list[Settled]:
    """:func:`settle` for every row of a pass, in one loop (the scheduler settles every row of
    every pass: the simulator's hot path). Row ``i`` has ``counters[i]``, a draft of
    ``draft_lens[i]`` tokens, its verification's ``emitted[i]`` tokens of which ``num_accepted[i]``
    were draft tokens, ``out_lens[i]`` tokens so far and room for ``limits[i]`` in all.
    """
    kept = []
    keep = kept.append
    make = tuple.__new__
    for c, k, em, acc, out_len, limit in zip(counters, draft_lens, emitted, num_accepted, out_lens, limits):
        room = limit - out_len
        n = len(em)
        if stops or room < n:
            n = cut_emitted(em, stops, room)
        if acc > n:
            acc = n
        if k:
            c.record(k, acc)
        else:  # an undrafted pass: the common case, counted without the call
            c.num_forward_passes += 1
        if n and stops and em[n - 1] in stops:
            keep(make(Settled, (n, acc, "stop")))
        else:
            keep(make(Settled, (n, acc, "length" if n >= room else "")))
    return kept
