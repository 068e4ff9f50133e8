"""THE verifier: one acceptance code path for every method and engine-agnostic rule.

Rules (DESIGN.md section 3):
- ``exact``: at each draft node sample y from the processed target with the coupled uniform of
  that output position; descend to the child whose token is y, else emit y and stop; after the
  last accepted node emit one more sampled token (the bonus). Lossless for any draft, chain or
  tree, and emits exactly the tokens plain sampling would.
- ``ratio`` (SPEC-RL as released, chains only): accept draft token x while
  u' <= min(1, lenience * p(x) / q(x)) with u' from an independent coupled stream; at the first
  rejection emit a plain sample from p (no residual). Lossy at every lenience.
- ``greedy``: accept while the draft equals the argmax (exact at temperature 0 only: at
  temperature > 0 it would silently decode argmax, so :func:`check_rule` refuses it).

Sampling and verification read fp32 logits at least (fp16/bf16 are upcast here; the torch_ref
engine also computes its output layer in fp32) and float64 logits as they are. Every emitted
token gets a signed margin (:func:`token_margins`, in probability mass): how far its coupled
uniform lies inside its CDF interval, negative when u does not select it; ``bench.precision``
uses it to tell near-ties from rule divergences in low-precision runs.

Exercised by ``pytest tests/test_verify.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from methods.base import Draft

from .sampling import (STREAM_ACCEPT, STREAM_SAMPLE, SamplingConfig, processed_probs_and_cut_margin,
                       sample_from_cdf, scaled_logits, uniforms)

RULES = ("exact", "ratio", "greedy")


@dataclass
class VerifyConfig:
    """The acceptance rule and its knob.

    ``ratio`` reads p(x) = softmax(logits / T)(x) of the current policy and q(x) = the draft's
    stored logprob (for prefix reuse, the old rollout's logprob as its engine returned it: also
    log-softmax of logits / T, before any top-p/top-k cut). So under top-p/top-k the test compares
    temperature-scaled distributions, not the processed (cut) ones; the token emitted at the first
    rejection (and the bonus) is a sample of the processed target. ``bench.bias`` computes the
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


@dataclass
class Verdict:
    """What verification of one row decided.

    ``emitted[i]`` was sampled at local node ``path[i]`` (0 = the rollout's last token, j >= 1 =
    draft node j-1); ``path[1:]`` are the accepted draft nodes, in order.
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


def token_margins(logits: torch.Tensor, cdf: torch.Tensor | None, cut: torch.Tensor | None, u: torch.Tensor,
                  rows: torch.Tensor, nodes: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    """Signed margins of tokens ``toks`` emitted at local nodes ``nodes`` of rows ``rows`` (all [B, W]).

    Sampled (cdf = cumsum of the processed probs [B, K, V], Z = cdf[-1], u [B, K]): token y's
    interval is [cdf(y-1), cdf(y)); margin = min(u Z - cdf(y-1), cdf(y) - u Z) / Z, positive when
    u selects y, negative by how far u lies outside y's interval otherwise; then capped by the
    position's top-k/top-p cut margin ``cut`` [B, K] (``processed_probs_and_cut_margin``).
    Greedy (cdf None): p(y) - max over z != y of p(z) with p = softmax(logits), i.e. the top-1
    minus top-2 probability gap for the argmax and negative for any other token.
    One gather over the batch, no per-token Python. Returns [B, W] float64.
    """
    if cdf is None:
        lse = torch.logsumexp(logits.double(), dim=-1)[rows, nodes]
        top2 = torch.topk(logits, 2, dim=-1)
        first, second = top2.values.double()[rows, nodes].unbind(-1)
        own = logits[rows, nodes, toks].double()
        other = torch.where(toks == top2.indices[rows, nodes, 0], second, first)
        return torch.exp(own - lse) - torch.exp(other - lse)
    z = cdf[rows, nodes, -1]
    hi = cdf[rows, nodes, toks]
    lo = torch.where(toks > 0, cdf[rows, nodes, (toks - 1).clamp(min=0)], 0.0)
    x = u[rows, nodes] * z
    return torch.minimum(torch.minimum(x - lo, hi - x) / z, cut[rows, nodes])


def verify_batch(logits: torch.Tensor, drafts: list[Draft], keys: torch.Tensor, out_lens: list[int],
                 sampling: SamplingConfig, verify: VerifyConfig) -> list[Verdict]:
    """Verify the drafts of a batch of rows in one go.

    logits: [B, K, V], row b's local node j (0 = last token, j >= 1 = draft node j-1) at [b, j]
    for j <= len(drafts[b]); the rest is padding. keys: [B] int64 rollout keys; out_lens[b]:
    output length of row b before this iteration (the output position sampled at local node 0).
    fp16/bf16 logits are read in fp32, float64 ones as they are.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    B, K, _ = logits.shape
    positions = torch.tensor([[o + x for x in ds] + [o] * (K - len(ds))
                              for o, ds in zip(out_lens, (node_depths(d) for d in drafts))])
    u = uniforms(keys, positions, STREAM_SAMPLE).to(logits.device)
    greedy = verify.rule == "greedy" or sampling.greedy
    if greedy:
        sampled, cdf, cut = logits.argmax(-1), None, None
    else:
        probs, cut = processed_probs_and_cut_margin(logits, sampling)
        cdf = torch.cumsum(probs, dim=-1)
        sampled = sample_from_cdf(cdf, u)
    scaled = scaled_logits(logits, sampling)
    lse = torch.logsumexp(scaled, dim=-1)  # [B, K]
    if K == 1:  # nothing drafted anywhere: plain sampling, one token per row
        rows, nodes = torch.arange(B, device=logits.device)[:, None], torch.zeros_like(sampled)
        lp = (scaled[:, 0].gather(-1, sampled) - lse).tolist()
        mg = token_margins(logits, cdf, cut, u, rows, nodes, sampled).tolist()
        return [Verdict([y[0]], [0], [l[0]], [m[0]]) for y, l, m in zip(sampled.tolist(), lp, mg)]
    sampled_l = sampled.tolist()

    if verify.rule == "ratio":
        accept_u = uniforms(keys, positions, STREAM_ACCEPT).tolist()
        draft_tok = torch.tensor([d.token_ids + [0] * (K - len(d)) for d in drafts], device=logits.device)
        if greedy:  # the target is the one-hot argmax: p(x) is 1 or 0
            target = torch.where(draft_tok == sampled, 0.0, float("-inf"))
        else:
            target = scaled.gather(-1, draft_tok[..., None]).squeeze(-1) - lse
        target_logp = target.tolist()

    verdicts: list[Verdict] = []
    for b, d in enumerate(drafts):
        if verify.rule == "ratio" and len(d):
            if not d.is_chain:
                raise ValueError("verify.rule=ratio verifies chain drafts only; use rule=exact for trees")
            emitted, path = ratio_accept(d, sampled_l[b], accept_u[b], target_logp[b], verify.lenience)
        else:
            emitted, path = descend(sampled_l[b], d)
        verdicts.append(Verdict(emitted, path))

    # logprobs of emitted tokens under the current policy: one gather for the whole batch
    width = max(len(v.emitted) for v in verdicts)
    idx_node = torch.tensor([v.path + [0] * (width - len(v.path)) for v in verdicts], device=logits.device)
    idx_tok = torch.tensor([v.emitted + [0] * (width - len(v.emitted)) for v in verdicts], device=logits.device)
    rows = torch.arange(B, device=logits.device)[:, None]
    lp = (scaled[rows, idx_node, idx_tok] - lse[rows, idx_node]).tolist()
    mg = token_margins(logits, cdf, cut, u, rows, idx_node, idx_tok).tolist()
    for b, v in enumerate(verdicts):
        v.logprobs = lp[b][:len(v.emitted)]
        v.margins = mg[b][:len(v.emitted)]
    return verdicts
