"""Coupled sampling: stateless uniforms and processed target distributions, shared by every method.

The uniform used at output position t of rollout (prompt_id, sample_idx) at step s under seed k
is a pure function of (k, s, prompt_id, sample_idx, t, stream). Exact verification samples the
target with that same number at every draft position, so the baseline and every exact method
emit the *same tokens* (docs/design.md, "Coupled sampling"). Exercised by ``pytest tests/test_sampling.py``.
"""
from __future__ import annotations

import torch

from bench.core.coupling import (GOLDEN, MASK64, MIX1, MIX2, STREAM_ACCEPT, STREAM_SAMPLE,  # noqa: F401 (re-exported)
                                 SamplingConfig, _signed, rollout_seed, splitmix64, stable_hash, uniform_reference)

SMALL_BATCH = 32  # up to this many uniforms, the scalar reference is faster than tensor ops


# ---------------------------------------------------------------- uniforms (vectorised, int64 tensors)

def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic: mask off the sign extension)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _splitmix64_t(z: torch.Tensor) -> torch.Tensor:
    z = z + _signed(GOLDEN)  # int64 arithmetic wraps modulo 2**64
    z = (z ^ _srl(z, 30)) * _signed(MIX1)
    z = (z ^ _srl(z, 27)) * _signed(MIX2)
    return z ^ _srl(z, 31)


def uniforms(keys: torch.Tensor, positions: torch.Tensor, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """Uniforms in (0, 1) as float64.

    keys: [B] int64 (from :func:`rollout_seed`); positions: [B, q] int64 output positions.
    Returns [B, q] float64, equal to :func:`uniform_reference` element by element.
    """
    if positions.numel() <= SMALL_BATCH:  # a few Python ints are cheaper than ~20 tensor ops
        ks, ps = keys.tolist(), positions.tolist()
        return torch.tensor([[uniform_reference(k, t, stream) for t in row] for k, row in zip(ks, ps)],
                            dtype=torch.float64)
    pos = positions.to(torch.int64)
    z = keys.to(torch.int64).to(pos.device)[:, None] ^ (pos * _signed(GOLDEN)) ^ _signed((stream * MIX2) & MASK64)
    z = _splitmix64_t(z)
    return (_srl(z, 11).to(torch.float64) + 0.5) / float(1 << 53)


# ---------------------------------------------------------------- processed distribution

def scaled_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Logits divided by the temperature (unchanged under greedy): what returned logprobs use."""
    return logits if cfg.greedy or cfg.temperature == 1.0 else logits / cfg.temperature


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution the policy samples from: temperature, then top-k, then top-p.

    logits: [..., V] -> probs [..., V] float64. Greedy gives a one-hot on the argmax. Top-k keeps
    every token tied with the k-th largest; top-p keeps the smallest prefix (by descending
    probability, stable on ties) whose mass reaches top_p.
    """
    return processed_probs_and_cut_margin(logits, cfg)[0]


def processed_probs_and_cut_margin(logits: torch.Tensor, cfg: SamplingConfig,
                                   dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`processed_probs` and, per position, how close its top-k/top-p cut is to flipping.

    The cut margin [...] float64 is in probability mass before the cut: top-k, the softmax gap
    between the k-th and (k+1)-th largest tokens; top-p, min over the descending order of
    |mass before the token - top_p| (a token enters or leaves the nucleus when that crosses 0).
    +inf when neither cut is on (and under greedy, whose tie is the top-1/top-2 gap instead).
    A cut that flips between two forward passes renormalises the whole distribution, so a
    token's CDF margin (``bench.core.verify``) is capped by this margin (``bench.core.precision``).
    ``dtype``: the precision of the softmax and the cuts (the verifier passes the logits' own,
    fp32 or float64; the probs come back in it).
    """
    if cfg.greedy:
        inf = torch.full(logits.shape[:-1], float("inf"), dtype=torch.float64, device=logits.device)
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype), inf
    return processed_from_scaled(scaled_logits(logits, cfg).to(dtype), cfg)


def processed_from_scaled(x: torch.Tensor, cfg: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`processed_probs_and_cut_margin` on logits already divided by the temperature (and in
    the working dtype); ``x`` is left unchanged. Not for greedy."""
    cut = torch.full(x.shape[:-1], float("inf"), dtype=torch.float64, device=x.device)
    if 0 < cfg.top_k < x.shape[-1]:
        top = torch.topk(x, cfg.top_k + 1, dim=-1).values
        kth = top[..., -2:-1]
        lse = torch.logsumexp(x, dim=-1)
        cut = (torch.exp(top[..., -2] - lse) - torch.exp(top[..., -1] - lse)).to(torch.float64)
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if cfg.top_p < 1.0:
        drop, gap = nucleus_drop(probs, cfg.top_p)
        cut = torch.minimum(cut, gap.to(torch.float64))
        probs.masked_fill_(drop, 0.0)
        probs.div_(probs.sum(-1, keepdim=True))
    return probs, cut


# candidate counts tried by the exact top-p prefilter before a full sort of the vocabulary
TOP_P_CANDIDATES = (1024, 16384)


def nucleus_drop(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p cut of ``probs`` [..., V]: (drop [..., V] bool, gap [...]), as a stable descending sort
    of the whole vocabulary gives them: a token is dropped when the mass before it in that order
    reaches top_p; gap = min over nonzero tokens of |mass before - top_p|.

    A stable sort of 152k tokens costs tens of ms per position on a CPU core, so each row first
    takes its ``k`` largest tokens for k in ``TOP_P_CANDIDATES`` (k at most an eighth of the
    vocabulary; a partial selection, then a stable sort of the k + 1 candidates by probability
    and index: the full sort's order) and keeps that answer only where it is provably the full
    sort's: the mass of the k reaches top_p with room for rounding (so every token past them is
    dropped), and no kept token ties with the first token left out (so the kept set does not
    depend on which of equal tokens the selection returned). Other rows try the next k, then the
    full sort. The mass before each candidate is the prefix sum of the same values in the same
    order as in the full sort, so the drop mask is the full sort's, bit for bit on CPU (a GPU scan
    may round a long prefix differently in its last bit); gap leaves out the tokens past the
    candidates, whose mass before is the last candidate's or more (up to that rounding).
    ``tests/test_sampling.py`` checks both against the full sort, ties included.
    """
    shape = probs.shape
    flat = probs.reshape(-1, shape[-1])
    n, V = flat.shape
    drop = torch.ones(n, V, dtype=torch.bool, device=probs.device)
    gap = torch.empty(n, dtype=probs.dtype, device=probs.device)
    todo = torch.arange(n, device=probs.device)
    slack = 4 * torch.finfo(probs.dtype).eps
    for k in TOP_P_CANDIDATES:
        if not len(todo) or 8 * k > V:  # a small vocabulary sorts as fast as it selects
            break
        sub = flat[todo]
        vals, idx = torch.topk(sub, k + 1, dim=-1)
        idx, perm = idx.sort(dim=-1)  # candidates by index, then stably by probability: the full sort's order
        vals, order = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
        idx = idx.gather(-1, order)
        cum = torch.cumsum(vals, dim=-1)
        before = cum - vals
        kept = before < top_p  # positions 0..k, as the full sort would decide them
        last = torch.where(kept, torch.arange(k + 1, device=probs.device), 0).amax(-1)  # the last kept position
        ok = (cum[:, k - 1] - slack >= top_p) & ~kept[:, k]
        ok &= (vals[:, k - 1] > vals[:, k]) | (vals.gather(-1, last[:, None]).squeeze(-1) > vals[:, k])
        rows = todo[ok]
        keep = torch.zeros(len(rows), V, dtype=torch.bool, device=probs.device)
        drop[rows] = ~keep.scatter_(-1, idx[ok], kept[ok])
        gap[rows] = (before[ok] - top_p).abs().masked_fill(vals[ok] == 0, float("inf")).amin(-1)
        todo = todo[~ok]
    if len(todo):  # the reference: a stable sort of the whole vocabulary
        sorted_p, order = torch.sort(flat[todo], dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= top_p
        gap[todo] = (before - top_p).abs().masked_fill(sorted_p == 0, float("inf")).amin(-1)
        drop[todo] = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return drop.reshape(shape), gap.reshape(shape[:-1])


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token whose CDF interval holds u: probs [..., V], u [...] in (0,1) -> int64 [...]."""
    return sample_from_cdf(torch.cumsum(probs.to(torch.float64), dim=-1), u)


def sample_from_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`sample_inverse_cdf` on a cumulative sum cdf [..., V] (unnormalised) already computed:
    the first token y with u * cdf[-1] < cdf[y]."""
    target = (u.to(torch.float64) * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=cdf.shape[-1] - 1)
