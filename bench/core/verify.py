"""THE verifier: one acceptance code path for every method and engine-agnostic rule.

Rules (docs/design.md, "The verifier"):
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
uniform lies inside its CDF interval, negative when u does not select it; ``bench.core.precision``
uses it to tell near-ties from rule divergences in low-precision runs.

At real sizes (a 152k vocabulary, batch 128 x 25 nodes, 4,096-token prefix-reuse drafts) nothing
of size batch x nodes x vocabulary exists: :func:`verify_nodes` reads the logits of real
(row, node) pairs only, flattened and ragged, a chunk at a time, and a long draft in windows
that stop at its first rejection; softmax and cuts run in fp32 (float64 for a float64 model),
the CDF in float64, top-p through an exact prefilter (``bench.core.sampling.nucleus_drop``).
:func:`verify_batch` is the same on padded [B, K, V] logits. ``python -m bench.benchmarks
verify-scale`` measures memory and time against the previous verifier.

Exercised by ``pytest tests/test_verify.py`` and ``tests/test_scale.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from methods.base import Draft

from bench.core.sampling import (STREAM_ACCEPT, STREAM_SAMPLE, SamplingConfig, processed_from_scaled, sample_from_cdf,
                       scaled_logits, uniforms)
from bench.core.verdicts import (MAX_WINDOW, RULES, WINDOW, Verdict, VerifyConfig, check_rule,  # noqa: F401 (re-exported)
                                 descend, node_depths, nodes_read, ratio_accept)

def token_margins(logits: torch.Tensor, cdf: torch.Tensor | None, cut: torch.Tensor | None, u: torch.Tensor,
                  at: torch.Tensor, toks: torch.Tensor, lse64: torch.Tensor | None = None) -> torch.Tensor:
    """Signed margins of tokens ``toks`` [m] at rows ``at`` [m] of a chunk of verified nodes.

    Sampled (cdf = cumsum of the processed probs [n, V] in float64, Z = cdf[-1], u [n]): token y's
    interval is [cdf(y-1), cdf(y)); margin = min(u Z - cdf(y-1), cdf(y) - u Z) / Z, positive when
    u selects y, negative by how far u lies outside y's interval otherwise; then capped by the
    node's top-k/top-p cut margin ``cut`` [n] (``processed_probs_and_cut_margin``).
    Greedy (cdf None): p(y) - max over z != y of p(z) with p = softmax(logits [n, V]), i.e. the
    top-1 minus top-2 probability gap for the argmax and negative for any other token
    (``lse64``: logsumexp of the float64 logits, [n], computed here when not given).
    One gather for the chunk, no per-token Python. Returns [m] float64.
    """
    if cdf is None:
        lse = (torch.logsumexp(logits.double(), dim=-1) if lse64 is None else lse64)[at]
        top2 = torch.topk(logits, 2, dim=-1)
        first, second = top2.values.double()[at].unbind(-1)
        own = logits[at, toks].double()
        other = torch.where(toks == top2.indices[at, 0], second, first)
        return torch.exp(own - lse) - torch.exp(other - lse)
    z = cdf[at, -1]
    hi = cdf[at, toks]
    lo = torch.where(toks > 0, cdf[at, (toks - 1).clamp(min=0)], 0.0)
    x = u[at] * z
    return torch.minimum(torch.minimum(x - lo, hi - x) / z, cut[at])


# Memory and windows. Logits are read for the real (row, node) pairs only, flattened and ragged,
# in chunks of CHUNK_BYTES of fp32 logits (softmax, top-p and CDF one chunk at a time: the
# verifier's workspace is a few chunks, however many nodes a batch verifies; small chunks stay in
# a CPU's caches, a GPU wants fewer, larger kernels). A row's draft is verified in windows: first
# WINDOW nodes; a row whose every node so far was accepted continues with a window twice as long
# (at most MAX_WINDOW), from the same forward's hidden states, so a 4,096-token draft rejected at
# node 10 reads WINDOW nodes' logits, not 4,097.
CHUNK_BYTES = {"cpu": 8 << 20, "cuda": 256 << 20}

LogitsAt = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RowVerification:
    """Verification state of one row: per local node, what its logits decided."""

    draft: Draft
    depths: list[int]
    children: list[list[int]]  # children[j]: local nodes whose parent is local node j
    sampled: list  # token sampled at each local node (None: not read yet)
    lp: list  # logprob / margin of the sampled token at each node
    mg: list
    lp_in: list  # lp_in[c] / mg_in[c]: logprob / margin of node c's draft token at its parent
    mg_in: list
    accept_u: list = field(default_factory=list)  # ratio rule: the acceptance stream at each draft node
    end: int = 0  # nodes [0, end) are the ones read so far (some skipped in a tree)
    window: int = 0
    start: int = 0  # first node of the next window
    verdict: Verdict | None = None


def verify_batch(logits: torch.Tensor, drafts: list[Draft], keys: torch.Tensor, out_lens: list[int],
                 sampling: SamplingConfig, verify: VerifyConfig) -> list[Verdict]:
    """Verify the drafts of a batch of rows from padded logits.

    logits: [B, K, V], row b's local node j (0 = last token, j >= 1 = draft node j-1) at [b, j]
    for j <= len(drafts[b]); the rest is padding and never read. keys: [B] int64 rollout keys;
    out_lens[b]: output length of row b before this iteration (the output position sampled at
    local node 0). fp16/bf16 logits are read in fp32, float64 ones as they are. The same as
    :func:`verify_nodes` with ``logits_at = lambda rows, nodes: logits[rows, nodes]``.
    """
    return verify_nodes(lambda rows, nodes: logits[rows.to(logits.device), nodes.to(logits.device)],
                        logits.shape[-1], drafts, keys, out_lens, sampling, verify, device=logits.device)


def verify_nodes(logits_at: LogitsAt, vocab: int, drafts: list[Draft], keys: torch.Tensor, out_lens: list[int],
                 sampling: SamplingConfig, verify: VerifyConfig, window: int | None = None,
                 device: torch.device | str = "cpu", reads_at: ReadsAt | None = None) -> list[Verdict]:
    """Verify the drafts of a batch of rows, reading logits only where the descent needs them.

    ``logits_at(rows, nodes)`` (two [n] int64 CPU tensors: row b, local node j) returns the [n, V]
    logits of those (row, node) pairs, on any device, in any float dtype; the torch_ref engine
    applies the output layer to the gathered hidden states of exactly these nodes. It is called
    once per chunk (``CHUNK_BYTES[device type]``) of each window round (``WINDOW``; ``window``
    overrides it). ``reads_at`` instead of logits: the engine read the nodes itself (with
    :func:`read_logits`, where its logits are) and returns their :class:`NodeRead`.
    Softmax, cuts and logprobs are computed in fp32 (float64 logits stay float64), the CDF and the
    margins in float64, so the verdicts do not depend on the chunking or the windows: the same
    tokens, logprobs and margins as verifying every node at once.
    """
    first = WINDOW if window is None else window
    chunk = max(1, CHUNK_BYTES.get(torch.device(device).type, CHUNK_BYTES["cpu"]) // (4 * vocab))
    if reads_at is not None:  # reads are a few numbers a node: a window round is one request to the engine
        chunk = 1 << 62
    greedy = verify.rule == "greedy" or sampling.greedy
    keys_l = [int(k) for k in keys.tolist()]
    rows = []
    for d in drafts:
        n = 1 + len(d)
        children: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(d.parent_list()):
            children[p + 1].append(i + 1)
        if verify.rule == "ratio" and len(d) and not d.is_chain:
            raise ValueError("verify.rule=ratio verifies chain drafts only; use rule=exact for trees")
        rows.append(RowVerification(d, node_depths(d), children, [None] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n,
                         window=max(1, first)))
    if verify.rule == "ratio" and any(len(d) for d in drafts):
        width = max(len(d) for d in drafts)
        pos = torch.tensor([[o + i for i in range(width)] for o in out_lens], dtype=torch.int64)
        for r, d, au in zip(rows, drafts, uniforms(keys.cpu(), pos, STREAM_ACCEPT).tolist()):
            r.accept_u = au[:len(d)]
    live = list(range(len(rows)))
    while live:
        todo = []  # (row, node) pairs read this round
        for b in live:
            r = rows[b]
            stop = min(len(r.sampled), r.start + r.window)
            todo += [(b, j) for j in range(r.start, stop)]
            r.end = stop
        _read(todo, rows, logits_at, reads_at, keys_l, out_lens, sampling, greedy, chunk)
        live = [b for b in live if not _descend(rows[b], verify, greedy)]
        for b in live:
            rows[b].window = min(2 * rows[b].window, max(MAX_WINDOW, first))
    return [r.verdict for r in rows]


@dataclass
class NodeRead:
    """What one node's logits decide: the token sampled there, its logprob and margin, and the
    logprob and margin of each probe token (the draft tokens of the node's children, in order)."""

    sampled: int
    lp: float
    mg: float
    probe_lp: list[float]
    probe_mg: list[float]


# reads_at(pairs): the NodeRead of each (row, local node) pair, in order; an engine that computes
# them where its logits are (vLLM's worker, ``bench.engines.vllm.node_reads``) passes one to verify_nodes
ReadsAt = Callable[[list[tuple[int, int]]], list[NodeRead]]


def read_logits(logits: torch.Tensor, keys: list[int], positions: list[int], probes: list[list[int]],
                sampling: SamplingConfig, greedy: bool) -> list[NodeRead]:
    """The rule's reading of n nodes' logits [n, V]: the coupled sample of each (its rollout key,
    its output position), its logprob (log_softmax(logits / T)) and margin, and those of each
    node's probe tokens. fp16/bf16 logits are read in fp32."""
    kid_at = [i for i, ps in enumerate(probes) for _ in ps]
    sampled, lp, mg = _read_flat(logits, keys, positions, kid_at, [t for ps in probes for t in ps], sampling, greedy)
    out, k = [], len(keys)
    for i, (y, ps) in enumerate(zip(sampled, probes)):
        out.append(NodeRead(y, lp[i], mg[i], lp[k:k + len(ps)], mg[k:k + len(ps)]))
        k += len(ps)
    return out


def _read_flat(logits: torch.Tensor, keys: list[int], positions: list[int], kid_at: list[int], kid_tok: list[int],
               sampling: SamplingConfig, greedy: bool) -> tuple[list[int], list[float], list[float]]:
    """:func:`read_logits` without objects (the hot path of torch_ref's verifier): the n sampled
    tokens, then logprobs and margins of the n samples followed by the probes (``kid_tok[m]`` read
    at node ``kid_at[m]``)."""
    n = len(keys)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    dev = logits.device
    pos = torch.tensor([[p] for p in positions], dtype=torch.int64)
    u = uniforms(torch.tensor(keys, dtype=torch.int64), pos, STREAM_SAMPLE)[:, 0].to(dev)
    scaled = scaled_logits(logits, sampling)
    lse = torch.logsumexp(scaled, dim=-1)
    if greedy:
        sampled, cdf, cut = logits.argmax(-1), None, None
        lse64 = torch.logsumexp(logits.double(), dim=-1)
    else:
        probs, cut = processed_from_scaled(scaled, sampling)
        cdf = probs.to(torch.float64)  # the CDF in float64, in place: one vocabulary-wide copy at a time
        del probs
        cdf.cumsum_(dim=-1)
        sampled, lse64 = sample_from_cdf(cdf, u), None
    at = torch.cat([torch.arange(n, device=dev), torch.tensor(kid_at, dtype=torch.int64, device=dev)])
    toks = torch.cat([sampled, torch.tensor(kid_tok, dtype=torch.int64, device=dev)])
    lp = (scaled[at, toks] - lse[at]).tolist()
    mg = token_margins(logits, cdf, cut, u, at, toks, lse64).tolist()
    return sampled.tolist(), lp, mg


def node_probes(draft: Draft) -> list[list[int]]:
    """Each local node's probe tokens: the draft tokens of its children, in node order."""
    probes: list[list[int]] = [[] for _ in range(len(draft) + 1)]
    for i, (tok, p) in enumerate(zip(draft.token_ids, draft.parent_list())):
        probes[p + 1].append(tok)
    return probes


def _read(todo: list[tuple[int, int]], rows: list[RowVerification], logits_at: LogitsAt | None,
          reads_at: ReadsAt | None, keys: list[int], out_lens: list[int], sampling: SamplingConfig, greedy: bool,
          chunk: int) -> None:
    """Read the (row, node) pairs ``todo`` chunk by chunk and record, per node, the sampled token
    and its logprob and margin, and each child's draft token's logprob and margin."""
    for s in range(0, len(todo), chunk):
        part = todo[s:s + chunk]
        if reads_at is not None:
            for (b, j), rd in zip(part, reads_at(part)):
                r = rows[b]
                r.sampled[j], r.lp[j], r.mg[j] = rd.sampled, rd.lp, rd.mg
                for c, lp, mg in zip(r.children[j], rd.probe_lp, rd.probe_mg):
                    r.lp_in[c], r.mg_in[c] = lp, mg
            continue
        # the draft tokens of every child of a node in this chunk, read at that node
        kid_at, kid_tok, kids = [], [], []
        for i, (b, j) in enumerate(part):
            r = rows[b]
            for c in r.children[j]:
                kid_at.append(i)
                kid_tok.append(r.draft.token_ids[c - 1])
                kids.append((b, c))
        logits = logits_at(torch.tensor([b for b, _ in part], dtype=torch.int64),
                           torch.tensor([j for _, j in part], dtype=torch.int64))
        sampled, lp, mg = _read_flat(logits, [keys[b] for b, _ in part],
                                     [out_lens[b] + rows[b].depths[j] for b, j in part], kid_at, kid_tok,
                                     sampling, greedy)
        del logits
        n = len(part)
        for i, ((b, j), y) in enumerate(zip(part, sampled)):
            r = rows[b]
            r.sampled[j], r.lp[j], r.mg[j] = y, lp[i], mg[i]
        for i, (b, c) in enumerate(kids):
            rows[b].lp_in[c], rows[b].mg_in[c] = lp[n + i], mg[n + i]


def _descend(r: RowVerification, verify: VerifyConfig, greedy: bool) -> bool:
    """Run the rule over the nodes read so far; True (and ``r.verdict`` set) when more nodes
    cannot change the verdict, else False with ``r.start`` at the next node to read."""
    d, e = r.draft, r.end
    trunc = d.truncated(e - 1)  # the nodes read so far (parents precede children: still a forest)
    if verify.rule == "ratio" and len(d):
        if greedy:  # the target is the one-hot argmax: p(x) is 1 or 0
            target = [0.0 if x == r.sampled[i] else float("-inf") for i, x in enumerate(trunc.token_ids)]
        else:
            target = r.lp_in[1:e]
        emitted, path = ratio_accept(trunc, r.sampled[:e], r.accept_u, target, verify.lenience) if len(trunc) \
            else ([r.sampled[0]], [0])
        nxt = e if len(path) == e and len(d) >= e else None  # all read nodes accepted: test the next
    else:
        emitted, path = descend(r.sampled[:e], trunc)
        last, y = path[-1], emitted[-1]  # the first child of the full draft the sample descends to
        nxt = next((c for c in r.children[last] if d.token_ids[c - 1] == y), None)
        if nxt is not None and nxt < e:
            nxt = None  # a read child the rule did not descend to (only a modified rule does that)
    if nxt is not None:
        r.start = nxt
        return False
    lps, mgs = [], []
    for node, tok in zip(path, emitted):
        if tok == r.sampled[node]:
            lps.append(r.lp[node])
            mgs.append(r.mg[node])
        else:  # a draft token the rule accepted where u did not select it: its own numbers
            c = next((c for c in r.children[node] if d.token_ids[c - 1] == tok), None)
            if c is None:
                raise AssertionError(f"verify: token {tok} emitted at node {node} was neither sampled there nor drafted")
            lps.append(r.lp_in[c])
            mgs.append(r.mg_in[c])
    r.verdict = Verdict(emitted, path, lps, mgs)
    return True
