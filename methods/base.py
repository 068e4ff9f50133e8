"""The contract between drafters and engines: rollout identity, drafts, finished rollouts.

Pure Python on purpose: a drafter never sees a tensor, so every method runs unchanged under the
torch reference engine, vLLM, SGLang and the model-free simulator (``python -m bench.harness.simulate``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class RolloutKey:
    """Identity of a rollout slot across RL steps: the same (prompt, sample) at every visit.

    Its hash is computed once and kept (drafters look every row up by key on every pass); the
    kept hash is never pickled, since a string's hash differs between processes."""

    prompt_id: str
    sample_idx: int  # 0..n-1 within the GRPO group

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:  # first use (or a key unpickled from before the hash was kept)
            h = hash((self.prompt_id, self.sample_idx))
            object.__setattr__(self, "_hash", h)
            return h

    def __reduce__(self):
        return (RolloutKey, (self.prompt_id, self.sample_idx))


@dataclass
class Draft:
    """Draft tokens proposed for the next output positions of one rollout.

    ``token_ids[i]`` is a guess for the token after its parent: ``parents[i] == -1`` means it
    continues the rollout's current output, ``parents[i] == j`` means it follows draft node j
    (j < i). ``parents=None`` is a chain (node i follows node i-1). ``logprobs`` are the draft
    policy's logprobs of the tokens; only the lenient ``ratio`` verifier rule reads them.
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] | None = None
    logprobs: list[float] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return self.parents is None or all(p == i - 1 for i, p in enumerate(self.parents))

    def parent_list(self) -> list[int]:
        """Parents as an explicit list (chains included)."""
        if self.parents is None:
            return list(range(-1, len(self.token_ids) - 1))
        return list(self.parents)

    def truncated(self, budget: int) -> "Draft":
        """The first ``budget`` nodes (parents precede children, so a prefix is still a forest).

        Budget counts draft tokens (tree nodes), as vLLM's num_speculative_tokens does.
        """
        if len(self.token_ids) <= budget:
            return self
        if budget <= 0:
            return NO_DRAFT
        return Draft(self.token_ids[:budget], None if self.parents is None else self.parents[:budget],
                     None if self.logprobs is None else self.logprobs[:budget])

    def validate(self) -> None:
        """Raise ValueError if parents do not describe a forest in topological order."""
        n = len(self.token_ids)
        if self.parents is not None:
            if len(self.parents) != n:
                raise ValueError(f"Draft has {n} tokens but {len(self.parents)} parents")
            for i, p in enumerate(self.parents):
                if not -1 <= p < i:
                    raise ValueError(f"Draft parent {p} of node {i} must be -1 or an earlier node")
        if self.logprobs is not None and len(self.logprobs) != n:
            raise ValueError(f"Draft has {n} tokens but {len(self.logprobs)} logprobs")


NO_DRAFT = Draft()
"""The empty draft, shared: a row with nothing to propose gets this one object (a draft is never
changed once proposed: ``truncated`` makes a new one), so the loop allocates nothing for it."""


@dataclass
class Rollout:
    """One finished rollout, as every engine returns it (plain lists: a trainer can use it as is).

    ``logprobs[i]`` is the current policy's logprob of ``token_ids[i]`` (log-softmax of the
    logits divided by the sampling temperature; raw logits under greedy decoding).
    ``margins[i]`` is the signed margin of ``token_ids[i]``'s coupled uniform to its CDF interval,
    in probability mass (``bench.core.verify.token_margins``; empty where the engine does not record
    them): ``bench.core.precision`` tells low-precision near-ties from rule divergences with it.
    """

    key: RolloutKey
    step: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS/stop token) or "length" (max_new_tokens)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_forward_passes: int = 0
    first_token_time: float = 0.0  # seconds since the rollout call started
    last_token_time: float = 0.0
    run_ahead: bool = False  # generated only to feed drafter caches (never used for training)
    anticipates: int | None = None  # run-ahead only: the step whose prompt it sampled early
    margins: list[float] = field(default_factory=list)


@runtime_checkable
class Drafter(Protocol):
    """What every method implements; the scheduler (``bench.spec.scheduler``) calls these in this
    order per rollout: ``start`` once, then ``propose``/``observe`` each iteration, then ``finish``
    as soon as the rollout ends (its siblings may still be running).

    Optional, not part of the protocol (``NullDrafter`` has them):

    - ``drafts``: what the method drafts, which decides the engine configuration it needs:
      ``"never"`` (the baseline), ``"first"`` (one draft at output length 0 only: SPEC-RL's prefix
      reuse, verified by a scoring pass) or ``"decoding"`` (drafts while decoding: the engine needs
      a speculative configuration). Engines read this declaration, never the drafter's class.
    - ``begin_iteration(live, budget=None)``: once per iteration, before its ``propose`` calls, with
      ``live`` = [(key, output length), ...] of every running row in batch order and ``budget`` the
      speculation policy's cap on every row's verified draft this iteration (None: no cap).
      Batch-aware drafters (Seer's tail-first pool) read it.
    - ``propose_batch(keys, outputs, budgets)`` / ``observe_batch(keys, new_tokens)``: the same calls
      for every row of an iteration at once, in batch order; each equals its per-row calls made in
      that order (``NullDrafter``'s do exactly that). The scheduler calls them, looked up on the
      type; a drafter overrides them only to do the same work with less per-row overhead.
    - ``verified(key, draft_len)``: the policy cut the last proposal of ``key`` to its first
      ``draft_len`` nodes before verifying it; ``observe`` then reports what those nodes produced.
      Adaptive drafters (RhymeRL's AIMD length) judge what was verified, not what they proposed.
    """

    def begin_step(self, step: int) -> None: ...

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None: ...

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft: ...

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None: ...

    def finish(self, key: RolloutKey, rollout: Rollout) -> None: ...


DRAFTS = ("never", "first", "decoding")


class NullDrafter:
    """A drafter that does nothing; subclasses override what they need. A subclass that overrides
    ``propose`` drafts while decoding unless it declares otherwise (``drafts``); one that overrides
    ``propose`` (``observe``) and not ``propose_batch`` (``observe_batch``) gets the per-row batch
    form back, so an inherited fast batch form does not skip that override (one that changes a
    helper the fast form bypasses, such as tree_cache's ``_draft``, overrides the batch form too)."""

    name = "null"
    drafts = "never"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "drafts" not in cls.__dict__ and cls.propose is not NullDrafter.propose:
            cls.drafts = "decoding"
        for one, batch in (("propose", "propose_batch"), ("observe", "observe_batch")):
            if one in cls.__dict__ and batch not in cls.__dict__:
                setattr(cls, batch, getattr(NullDrafter, batch))
        if cls.drafts not in DRAFTS:
            raise TypeError(f"{cls.__name__}.drafts must be one of {DRAFTS}, got {cls.drafts!r}")

    def begin_step(self, step: int) -> None:
        pass

    def start(self, key: RolloutKey, prompt: Sequence[int]) -> None:
        pass

    def begin_iteration(self, live: Sequence[tuple[RolloutKey, int]], budget: int | None = None) -> None:
        pass

    def propose(self, key: RolloutKey, output: Sequence[int], budget: int) -> Draft:
        return NO_DRAFT

    def propose_batch(self, keys: Sequence[RolloutKey], outputs: Sequence[Sequence[int]],
                      budgets: Sequence[int]) -> list[Draft]:
        """``propose`` for each row in order (what every batch form must equal)."""
        if type(self).propose is NullDrafter.propose:  # drafts nothing (the baseline): no calls
            return [NO_DRAFT] * len(keys)
        propose = self.propose
        return [propose(k, o, b) for k, o, b in zip(keys, outputs, budgets)]

    def verified(self, key: RolloutKey, draft_len: int) -> None:
        pass

    def observe(self, key: RolloutKey, new_tokens: Sequence[int]) -> None:
        pass

    def observe_batch(self, keys: Sequence[RolloutKey], new_tokens: Sequence[Sequence[int]]) -> None:
        """``observe`` for each row in order (what every batch form must equal)."""
        observe = self.observe
        for k, t in zip(keys, new_tokens):
            observe(k, t)

    def finish(self, key: RolloutKey, rollout: Rollout) -> None:
        pass
