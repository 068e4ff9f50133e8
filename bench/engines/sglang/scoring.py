"""The prefix path of SGLangEngine (bench.engines.sglang.adapter): the scoring requests that verify
a draft proposed at output length 0 (prefix reuse, SPEC-RL) and the suite's rule on what SGLang
returns, as a mixin so the adapter keeps the engine and its continuation, and this module the
logprob requests and how SGLang lays them out. ``score`` (logprobs of given responses) reads them
by node requests too (the full-distribution request only without the plain engine).

    python -m pytest -m sglang tests/test_engine_sglang.py   (CPU: in the rig venv, rigs/sglang_cpu/)

One scoring request per drafted row over prompt + draft, ``logprob_start_len=len(prompt)-1``
(SGLang gives no logprob for the token AT the start index, so starting at len(prompt) would lose
the first draft token's), asking for what the rule needs (``bench.core.drafting.scoring_logprobs``):
- ``ratio`` at temperature 1: the draft tokens' logprobs only (``input_token_logprobs``) and one
  sampled token after the draft (``max_new_tokens=1``: the bonus of a fully accepted draft);
  the token at the first rejection is sampled by the continuation (a plain sample of the
  target, as the rule says);
- greedy: the top-1 at each draft position (``top_logprobs_num=1``) and the greedy token after;
- ``exact`` at temperature > 0 (and ratio at T != 1): the coupled rule needs the whole
  distribution at every draft position, so it is read inside SGLang's scheduler by node requests
  (``bench.engines.sglang.node_reads``: nothing vocabulary-wide comes back), token-coupled with
  torch_ref in the draft region; approximate only in the last bits (SGLang's float error). Only
  on the NGRAM engine (``plain_engine_for: []``), which takes no custom processor here, is the
  full distribution requested (``top_logprobs_num=V``, ``max_new_tokens=0`` and one filler token
  for the position after the draft): V logprobs per draft position, heavy for 150k vocabularies.
"""
from __future__ import annotations

import math
import time

import torch

from methods.base import Draft, Drafter

from bench.core.drafting import scoring_logprobs, settle, verify_from_logprobs
from bench.core.sampling import SamplingConfig
from bench.core.verify import VerifyConfig, verify_batch
from bench.engines.sglang.partial import PartialRollout


class PrefixScoring:
    """SGLangEngine's scoring requests (see the module docstring). A mixin: it uses the engine's
    ``info``, ``engine``, ``spec_engine``, ``_params`` and ``_stops``, all set by SGLangEngine."""

    def _verify_prefix_drafts(self, engine, rows: list[PartialRollout], sampling: SamplingConfig, drafter: Drafter,
                              verify: VerifyConfig, t0: float) -> str | None:
        """Score every drafted row in one batch (logprobs as the rule needs, see the module
        docstring), decide with the suite's rule, emit the verdicts; returns the scoring kind."""
        budget = sampling.max_new_tokens - 1
        drafts: list[Draft] = []
        for row in rows:
            d = drafter.propose(row.request.key, [], budget) if budget > 0 else Draft()
            d = d.truncated(budget)
            if not d.is_chain:
                raise ValueError("the SGLang prefix path verifies chain drafts only (prefix reuse); "
                                 "tree drafts run through engine.speculative_algorithm=NGRAM")
            drafts.append(d)
        scored = [(row, d) for row, d in zip(rows, drafts) if len(d)]
        if not scored:
            return None
        greedy = sampling.greedy or verify.rule == "greedy"
        mode = scoring_logprobs(greedy, verify.rule, sampling.temperature)
        prompts = [row.request.prompt_token_ids for row, _ in scored]
        if mode == "full" and engine is self.engine:  # the rule read in SGLang's scheduler (node_reads)
            from bench.engines.sglang.node_reads import node_verifier
            verdicts, _ = node_verifier(self, self._calls).verify(
                [list(p) for p in prompts], [d for _, d in scored], [row.key64 for row, _ in scored],
                [0] * len(scored), sampling, verify)
            results = [(v.emitted, v.num_accepted, v.logprobs) for v in verdicts]
            fed = [len(p) + len(d) for p, (_, d) in zip(prompts, scored)]
        elif mode == "full":  # on the NGRAM engine (plain_engine_for: []): whole distributions
            logp = self._score_distributions(prompts, [d.token_ids for _, d in scored], engine)
            keys = torch.tensor([row.key64 for row, _ in scored], dtype=torch.int64)
            verdicts = verify_batch(logp, [d for _, d in scored], keys, [0] * len(scored), sampling, verify)
            results = [(v.emitted, v.num_accepted, v.logprobs) for v in verdicts]
            fed = [len(p) + len(d) + 1 for p, (_, d) in zip(prompts, scored)]  # + the filler token
        else:
            results = self._score_draft_tokens(engine, scored, sampling, verify, mode)
            fed = [len(p) + len(d) for p, (_, d) in zip(prompts, scored)]
        now = time.perf_counter() - t0
        stops = self._stops(sampling)
        for (row, d), (emitted, accepted, lps), n_fed in zip(scored, results, fed):
            row.counters.record_scoring(n_fed)
            kept = settle(row.counters, len(d), emitted, accepted, stops, 0, sampling.max_new_tokens)
            row.emit(emitted[:kept.n], lps[:kept.n], now)
            if kept.n:
                drafter.observe(row.request.key, emitted[:kept.n])
            row.finish_reason = kept.finish_reason
        return mode

    def _score_draft_tokens(self, engine, scored, sampling: SamplingConfig, verify: VerifyConfig, mode: str):
        """``top1`` / ``draft`` scoring: prompt + draft with one generated token after it; returns
        (emitted, accepted, logprobs) per row from ``bench.core.drafting.verify_from_logprobs``."""
        inputs = [list(row.request.prompt_token_ids) + list(d.token_ids) for row, d in scored]
        starts = [len(row.request.prompt_token_ids) - 1 for row, _ in scored]
        if mode == "top1":
            params = [{"max_new_tokens": 1, "temperature": 0.0} for _ in scored]
        else:
            params = [dict(self._params(row, sampling, 1), stop_token_ids=[]) for row, _ in scored]
        extra = {"top_logprobs_num": 1} if mode == "top1" else {}
        outs = engine.generate(input_ids=inputs, sampling_params=params, return_logprob=True,
                               logprob_start_len=starts, **extra)
        results = []
        for (row, d), out in zip(scored, outs):
            meta, k = out["meta_info"], len(d)
            bonus = (int(out["output_ids"][0]), float(meta["output_token_logprobs"][0][0]))
            if mode == "top1":
                tops = input_top_logprobs(meta, len(row.request.prompt_token_ids) - 1,
                                          len(row.request.prompt_token_ids), k)
                top1 = [(int(t[0][1]), float(t[0][0])) for t in tops] + [bonus]
                results.append(verify_from_logprobs(mode, d, row.key64, verify.lenience, top1=top1))
            else:
                got = (meta.get("input_token_logprobs") or [])[1:1 + k]  # entry 0 is the last prompt token's (None)
                # SGLang 0.5.23 reports the id of the vocabulary's last token as 0 ("clip padded hash
                # values from image tokens": x < vocab_size - 1); its logprob is that token's all the same
                last = self.info.vocab_size - 1
                if len(got) != k or any(g[0] is None or int(g[1]) not in (x, 0 if x >= last else x)
                                        for g, x in zip(got, d.token_ids)):
                    raise RuntimeError(f"SGLang returned input_token_logprobs {got[:3]}... for draft {d.token_ids[:3]}...: "
                                       f"expected the logprob of each draft token")
                results.append(verify_from_logprobs(mode, d, row.key64, verify.lenience,
                                                    draft_logprobs=[float(g[0]) for g in got], bonus=bonus))
        return results

    def _score_distributions(self, prompts: list[list[int]], responses: list[list[int]], engine=None) -> torch.Tensor:
        """[B, K, V] float64 raw log-softmax (temperature 1) of the policy at output positions
        0..len(response) of each row (the last one via a filler token); K = 1 + longest response,
        padding rows hold a uniform distribution."""
        engine = engine if engine is not None else self.engine if self.engine is not None else self.spec_engine
        vocab = self.info.vocab_size
        inputs = [list(p) + list(r) + [r[-1] if r else p[-1]] for p, r in zip(prompts, responses)]
        starts = [len(p) - 1 for p in prompts]
        outs = engine.generate(input_ids=inputs, sampling_params=[{"max_new_tokens": 0} for _ in inputs],
                               return_logprob=True, logprob_start_len=starts, top_logprobs_num=vocab)
        K = 1 + max(len(r) for r in responses)
        logp = torch.full((len(inputs), K, vocab), -math.log(vocab), dtype=torch.float64)
        for b, (p, r, out) in enumerate(zip(prompts, responses, outs)):
            row = torch.full((len(r) + 1, vocab), -1e30, dtype=torch.float64)
            for j, top in enumerate(input_top_logprobs(out["meta_info"], starts[b], len(p), len(r) + 1)):
                for lp, tok, *_ in top:
                    if lp is not None and tok < vocab:
                        row[j, tok] = lp
            logp[b, :len(r) + 1] = row
        return logp

    def score(self, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Logprobs of given responses under the loaded policy: log_softmax(logits / temperature)
        (raw at temperature 0), like the logprobs of a rollout. On the plain engine each response
        position is a node request read in SGLang's scheduler (``node_reads``): its token the probe."""
        if self.engine is not None:
            from bench.engines.sglang.node_reads import sglang_submit
            from bench.spec.node_backend import node_tag
            sampling = SamplingConfig(temperature=temperature)
            items = [(f"s{b}:{j}", list(p) + list(r[:j]),  # the key and position only matter to samples
                      node_tag(f"s{b}:{j}", 0, j, [t], sampling, temperature == 0))
                     for b, (p, r) in enumerate(zip(prompts, responses)) for j, t in enumerate(r)]
            reads = sglang_submit(lambda: self.engine)(items) if items else {}
            return [[reads[f"s{b}:{j}"].probe_lp[0] for j in range(len(r))] for b, r in enumerate(responses)]
        logp = self._score_distributions(prompts, responses)
        if temperature not in (0, 1):
            logp = torch.log_softmax(logp / temperature, dim=-1)
        return [[float(logp[b, j, t]) for j, t in enumerate(r)] for b, r in enumerate(responses)]


def input_top_logprobs(meta: dict, start: int, prompt_len: int, n: int) -> list[list]:
    """The top-logprob lists that predict input tokens prompt_len .. prompt_len + n - 1.

    SGLang returns one entry per input position from ``logprob_start_len`` on, and the entry at
    ``logprob_start_len`` itself is None (measured on 0.5.23: with logprob_start_len = len(prompt)
    the first response token gets no logprob). So the caller asks from len(prompt) - 1 and the
    entry for input position i sits at index i - start.
    """
    tops = meta.get("input_top_logprobs")
    if tops is None:
        raise RuntimeError("SGLang returned no input_top_logprobs: this sglang version does not support "
                           "top_logprobs_num on prompt tokens")
    got = tops[prompt_len - start:prompt_len - start + n]
    if len(got) != n or any(not t for t in got):
        raise RuntimeError(f"SGLang returned {len(tops)} input positions from {start}; expected "
                           f"distributions for positions {prompt_len}..{prompt_len + n - 1}")
    return got
