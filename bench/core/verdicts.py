"""The verifier's decisions without torch: the rule's config, a row's verdict, the exact descent
given the sampled tokens, SPEC-RL's ratio test, and how many nodes' logits a verdict read.

Why a module of its own: the recorded-tokens backend and the scheduler (``bench.spec``), which the
simulator runs with no model, need these and no tensor, so ``python -m bench.harness.simulate``
does not import torch. ``bench.core.verify`` (the verifier, on logits) uses and re-exports them.
Exercised by ``pytest tests/test_verify.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from methods.base import Draft

from bench.core.coupling import SamplingConfig

RULES = ("exact", "ratio", "greedy")


@dataclass
class VerifyConfig:
    """The acceptance rule and its knob.

    ``ratio`` reads p(x) = softmax(logits / T)(x) of the current policy and q(x) = the draft's
    stored logprob (for prefix reuse, the old rollout's logprob as its engine returned it: also
    log-softmax of logits / T, before any top-p/top-k cut). So under top-p/top-k the test compares
    temperature-scaled distributions, not the processed (cut) ones; the token emitted at the first
    rejection (and the bonus) is a sample of the processed target. ``bench.benchmarks.bias`` computes the
    resulting distribution with exactly these p~, q~ in the ratio.
    """

    rule: str = "exact"
    lenience: float = 1.0  # ratio rule only: l = exp(b); SPEC-RL's GRPO default is e^0.5

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"verify.rule must be one of {RULES}, got {self.rule!r}")
        if not self.lenience >= 1.0:
            raise ValueError(f"verify.lenience must be >= 1 (1 = no lenience), got {self.lenience}")

    @property
    def lossless(self) -> bool:
        return self.rule != "ratio"


def check_rule(verify: VerifyConfig, sampling: SamplingConfig) -> None:
    """Refuse a verify rule that cannot mean what it says with these sampling settings."""
    if verify.rule == "greedy" and not sampling.greedy:
        raise ValueError(f"verify.rule=greedy decodes argmax, but sampling.temperature={sampling.temperature} "
                         f"samples: set sampling.temperature=0 (sampling=greedy) or use verify.rule=exact")


@dataclass(slots=True)
class Verdict:
    """What verification of one row decided.

    ``emitted[i]`` was sampled at local node ``path[i]`` (0 = the rollout's last token, j >= 1 =
    draft node j-1); ``path[1:]`` are the accepted draft nodes, in order. ``path`` and ``margins``
    are only read once made (the simulator shares tuples of them between verdicts).
    """

    emitted: list[int]
    path: list[int]
    logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # signed margin of each emitted token

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def node_depths(draft: Draft) -> list[int]:
    """Depth of each local node: 0 for the root, 1 + parent's depth for draft nodes."""
    depths = [0]
    for p in draft.parent_list():
        depths.append(depths[p + 1] + 1)
    return depths


def descend(sampled: list[int], draft: Draft) -> tuple[list[int], list[int]]:
    """Exact/greedy descent given the token sampled at every local node.

    sampled[j] is the token drawn at local node j. Returns (emitted, path).
    Example: draft chain [5, 6, 7], sampled [5, 6, 9, 2] -> emitted [5, 6, 9], path [0, 1, 2].
    """
    children: dict[tuple[int, int], int] = {}
    for i, (tok, p) in enumerate(zip(draft.token_ids, draft.parent_list())):
        children.setdefault((p + 1, tok), i + 1)  # first node wins on duplicate siblings
    node, emitted, path = 0, [], [0]
    while True:
        y = sampled[node]
        emitted.append(y)
        child = children.get((node, y))
        if child is None:
            return emitted, path
        node = child
        path.append(node)


def ratio_accept(draft: Draft, sampled: list[int], accept_u: list[float], target_logp: list[float],
                 lenience: float) -> tuple[list[int], list[int]]:
    """SPEC-RL's lenient test on a chain: accept x_i while u'_i <= min(1, l * p(x_i)/q(x_i)).

    target_logp[i] = log p(x_i) under the current policy, draft.logprobs[i] = log q(x_i).
    At the first rejection emit sampled[i] (a plain sample from p at that position).
    """
    if draft.logprobs is None:
        raise ValueError("verify.rule=ratio needs draft logprobs: use a drafter that provides them "
                         "(prefix_reuse) or rule=exact")
    log_l = math.log(lenience)
    emitted, path = [], [0]
    for i, x in enumerate(draft.token_ids):
        log_ratio = log_l + target_logp[i] - draft.logprobs[i]
        if math.log(accept_u[i]) <= min(0.0, log_ratio):  # log_ratio may be -inf (p(x) = 0)
            emitted.append(x)
            path.append(i + 1)
        else:
            emitted.append(sampled[i])
            return emitted, path
    emitted.append(sampled[len(draft.token_ids)])
    return emitted, path


# A row's draft is verified in windows: first WINDOW nodes, then windows twice as long (at most
# MAX_WINDOW) while every node so far was accepted (``bench.core.verify``'s memory note).
WINDOW = 32
MAX_WINDOW = 512


def nodes_read(draft_len: int, path: Sequence[int], window: int = WINDOW, ratio: bool = False) -> int:
    """How many nodes' logits :func:`verify_nodes` reads for one row: a draft of ``draft_len``
    tokens whose verdict took ``path`` (its local nodes, root first; parents precede children, so
    a path increases). What the verifier's host work follows: every node of a window is read, the
    rejected ones too. Exact for chains and trees under every rule (the windows' ends and the path
    decide it; ``ratio``: the ratio rule, which reads on whenever every node read so far was
    accepted), so the simulator, whose paths are the engine's, counts what the engine reads."""
    n = 1 + draft_len
    if n <= window:
        return n
    reads, start, i, last = 0, 0, 0, len(path) - 1
    cap = max(MAX_WINDOW, window)
    while True:
        end = min(n, start + window)
        reads += end - start
        while i < last and path[i + 1] < end:
            i += 1
        if ratio and path[i] == end - 1 and draft_len >= end:
            start = end
        elif i < last:
            start = path[i + 1]
        else:
            return reads
        window = min(2 * window, cap)



def pass_nodes_read(draft_lens: Sequence[int], paths, ratio: bool = False) -> int:
    """:func:`nodes_read` summed over one pass's rows (``paths``: their verdicts' paths, read only
    when some draft is wider than the first window; below it every row reads all its nodes)."""
    if max(draft_lens, default=0) < WINDOW:
        return sum(draft_lens) + len(draft_lens)
    return sum(nodes_read(k, path, ratio=ratio) for k, path in zip(draft_lens, paths))