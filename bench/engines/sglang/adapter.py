"""SGLang behind the Engine protocol, so methods can be compared on a production engine.

    python -m bench.harness.cli engine=sglang trace=countdown_tiny 'method=[baseline,prefix_reuse,prefix_reuse_exact]'
    python -m pytest -m sglang tests/test_engine_sglang.py   (CPU: in the rig venv, rigs/sglang_cpu/)

Three paths, chosen by the drafter (``bench.core.drafting.drafter_mode``), each on the engine
configuration it needs: baseline and prefix reuse (``engine.plain_engine_for``, default both) on
an ``sglang.Engine`` with NO speculative settings; tree methods on one with
``speculative_algorithm=NGRAM`` (GPU only; with NGRAM set both engines run, each with
``mem_fraction_static`` of the device, 0.4 when unset). ``last_engine`` names the one that served
the last call.
- baseline: ``engine.generate(input_ids=...)`` with return_logprob; SGLang samples. Each request
  carries its rollout key as ``sampling_seed``; SGLang honours it only with
  ``deterministic: true`` (enable_deterministic_inference, GPU attention backends), otherwise
  its sampler runs from ``random_seed``: reproducible in distribution, not per rollout.
- prefix reuse (a drafter that proposes its whole draft at output length 0): one scoring request
  per drafted row over prompt + draft, ``logprob_start_len=len(prompt)-1`` (SGLang gives no
  logprob for the token AT the start index, so starting at len(prompt) would lose the first draft
  token's), asking for what the rule needs (``bench.core.drafting.scoring_logprobs``):
  - ``ratio`` at temperature 1: the draft tokens' logprobs only (``input_token_logprobs``) and one
    sampled token after the draft (``max_new_tokens=1``: the bonus of a fully accepted draft);
    the token at the first rejection is sampled by the continuation (a plain sample of the
    target, as the rule says);
  - greedy: the top-1 at each draft position (``top_logprobs_num=1``) and the greedy token after;
  - ``exact`` at temperature > 0 (and ratio at T != 1): the full distribution
    (``top_logprobs_num=V``, ``max_new_tokens=0`` and one filler token for the position after
    the draft), verified by ``bench.core.verify``: exact rejection sampling with the suite's coupled
    uniforms, token-coupled with torch_ref in the draft region; approximate only in the last
    bits (prefill vs decode float error, top-p/top-k boundary conventions of bench.core.sampling vs
    SGLang's sampler). V logprobs per draft position: heavy for 150k-token vocabularies.
  SGLang samples the rest of each unfinished row. The scoring request is one of the row's
  forward passes (torch_ref verifies the same draft inside its prefill); its cost is labelled in
  the rows' ``num_scoring_passes`` / ``num_scoring_tokens`` and per call in ``last_scoring``.
- any other drafter: SGLang's own NGRAM speculation (GPU only), fed with every earlier rollout
  (prompt + output) through its external corpus. This is the engine-native APPROXIMATION of the
  tree methods: one global trie across prompts (not per prompt), SGLang's drafts and its tree
  verification rather than the drafter's; the drafter is still told start/observe/finish so its
  statistics stay meaningful, and the counters come from SGLang's per-request meta_info.
``run_ahead`` is not supported (SGLang owns its batch).

Cut and counters: every emitted token goes through ``bench.core.drafting.settle`` / ``cut_emitted``
(the stop/room cut of every engine) into a ``DraftCounters``. Logprobs: SGLang's output logprobs
are log_softmax(logits / T) (raw under greedy), as torch_ref returns them; its input-token
logprobs are raw (T = 1), so the full scoring path rescales them from the whole distribution.
Token times: offline generate returns whole rollouts, so a rollout's first/last token times are
when its call returned.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from methods.base import Draft, Drafter, Rollout

from bench.core.drafting import (DraftCounters, cut_emitted, drafter_mode, scoring_logprobs, settle,  # noqa: F401
                        verify_from_logprobs)
from bench.core.sampling import SamplingConfig
from bench.core.errors import UserError
from bench.core.verify import VerifyConfig, check_rule, verify_batch
from bench.core.engine_protocol import Request, RunAheadSource, request_key64
from bench.engines.checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint

INSTALL_HINT = ("engine=sglang needs the sglang package in the running environment: on a GPU machine "
                "pip install -e '.[sglang]' in its own venv; on CPU build the test rig with "
                "bash rigs/sglang_cpu/build.sh and run with .venv-sglang/bin/python")


class SGLangUnavailable(UserError, ImportError):
    """sglang cannot be imported here; the message says what to install."""


def import_sglang(device: str = "cpu"):
    """Import sglang lazily (its CPU path needs SGLANG_USE_CPU_ENGINE=1 before the import)."""
    if device == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    try:
        import sglang
    except Exception as exc:  # ImportError, or a broken install failing at import time
        raise SGLangUnavailable(f"{INSTALL_HINT} (import sglang failed: {type(exc).__name__}: {exc})") from exc
    return sglang


class SGLangEngine:
    """``sglang.Engine`` over one checkpoint at a time; weights swapped in place between steps."""

    name = "sglang"

    def __init__(self, device: str = "cpu", dtype: str = "float32", attention_backend: str | None = None,
                 mem_fraction_static: float | None = None, random_seed: int = 0,
                 deterministic: bool = False, speculative_algorithm: str | None = None,
                 speculative_num_draft_tokens: int = 24, ngram_external_sam_budget: int = 8,
                 plain_engine_for: list[str] | tuple[str, ...] = ("baseline", "prefix"),
                 log_level: str = "error", extra_args: dict | None = None):
        if speculative_algorithm not in (None, "NGRAM"):
            raise ValueError(f"engine.speculative_algorithm must be null or NGRAM, got {speculative_algorithm!r}")
        plain_engine_for = list(plain_engine_for or [])
        if any(m not in ("baseline", "prefix") for m in plain_engine_for):
            raise ValueError(f"engine.plain_engine_for lists drafter modes from ['baseline', 'prefix'] (a method "
                             f"that drafts while decoding needs NGRAM), got {plain_engine_for!r}")
        self.device, self.dtype = device, dtype
        self.kwargs = dict(device=device, dtype=dtype, random_seed=random_seed, log_level=log_level,
                           enable_deterministic_inference=deterministic, skip_tokenizer_init=True)
        if attention_backend:
            self.kwargs["attention_backend"] = attention_backend
        two = speculative_algorithm == "NGRAM" and bool(plain_engine_for)  # a plain and an NGRAM engine
        if mem_fraction_static is not None or two:
            self.kwargs["mem_fraction_static"] = 0.4 if mem_fraction_static is None else mem_fraction_static
        self.kwargs.update(extra_args or {})
        self.spec_kwargs = None  # the NGRAM engine's settings (None: no speculative engine)
        if speculative_algorithm == "NGRAM":
            self.spec_kwargs = dict(self.kwargs, speculative_algorithm="NGRAM",
                                    speculative_num_draft_tokens=speculative_num_draft_tokens,
                                    speculative_ngram_external_sam_budget=ngram_external_sam_budget)
        self.speculative = speculative_algorithm
        self.plain_engine_for = plain_engine_for
        self.engine = None  # the engine with no speculative settings (None if every mode runs on NGRAM)
        self.spec_engine = None  # the NGRAM engine
        self.last_engine = ""  # "plain" or "speculative": the engine that served the last call
        self.last_scoring: dict = {}
        self.info: CheckpointInfo | None = None
        self._arch_key: str | None = None
        self._history: list[list[int]] = []  # finished rollouts (prompt + output) for the NGRAM corpus
        self._corpus_loaded = 0
        self.last_iterations = 0

    # ------------------------------------------------------------------ checkpoints
    def load(self, checkpoint: str | Path) -> None:
        """Start the engine on the first checkpoint; later ones of the same architecture are
        swapped in with update_weights_from_disk (which also flushes the prefix cache)."""
        info = inspect_checkpoint(Path(checkpoint))
        arch_key = json.dumps({k: v for k, v in info.config.to_dict().items()
                               if k not in ("_name_or_path", "transformers_version")}, sort_keys=True, default=str)
        if (self.engine is not None or self.spec_engine is not None) and arch_key == self._arch_key:
            for engine in (self.engine, self.spec_engine):
                if engine is None:
                    continue
                try:
                    res = engine.update_weights_from_disk(str(info.path))
                except Exception as exc:
                    raise CheckpointError(f"{info.path}: SGLang could not load these weights: {exc}") from exc
                ok, message = (res[0], res[1]) if isinstance(res, (tuple, list)) else (bool(res), "")
                if not ok and "flush" in str(message).lower():
                    ok, message = self._flush_cache(engine), f"{message} (and flush_cache kept failing)"
                if not ok:
                    raise CheckpointError(f"{info.path}: SGLang refused the weight update: {message}")
        else:
            self.close()
            sglang = import_sglang(self.device)
            builds = [("spec_engine", self.spec_kwargs)] if self.spec_kwargs is not None else []
            if self.spec_kwargs is None or self.plain_engine_for:
                builds.insert(0, ("engine", self.kwargs))
            for attr, kwargs in builds:  # both at the first load: no method's clock pays for a start
                try:
                    setattr(self, attr, sglang.Engine(model_path=str(info.path), **kwargs))
                except Exception as exc:
                    self.close()
                    raise CheckpointError(f"{info.path}: SGLang could not start on this checkpoint with the "
                                          f"engine settings {kwargs}: {exc}") from exc
            self._corpus_loaded = 0  # a new engine has no corpus yet
        self.info, self._arch_key = info, arch_key

    def _flush_cache(self, engine, tries: int = 100) -> bool:
        """Flush the prefix cache (stale KV of the old weights); the scheduler refuses while it still
        retires the last call's requests, so retry briefly."""
        for _ in range(tries):
            res = engine.flush_cache()
            if getattr(res, "success", res):
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        for attr in ("engine", "spec_engine"):
            engine = getattr(self, attr)
            if engine is not None:
                engine.shutdown()
                setattr(self, attr, None)

    def engine_for(self, drafter: Drafter) -> str:
        """'plain' (no speculative settings) or 'speculative' (NGRAM): the engine serving this drafter."""
        if self.spec_kwargs is None or drafter_mode(drafter) in self.plain_engine_for:
            return "plain"
        return "speculative"

    # ------------------------------------------------------------------ rollouts
    def rollout(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                verify: VerifyConfig, run_ahead: RunAheadSource | None = None) -> list[Rollout]:
        """Every request's rollout; ``run_ahead`` is not supported (SGLang owns the batch)."""
        if (self.engine is None and self.spec_engine is None) or self.info is None:
            raise RuntimeError("SGLangEngine.rollout called before load(checkpoint)")
        check_rule(verify, sampling)
        if not requests:
            return []
        for r in requests:
            self._check_prompt(r, sampling)
        mode = drafter_mode(drafter)
        if mode == "tree" and self.speculative != "NGRAM":
            raise ValueError(f"method {getattr(drafter, 'name', type(drafter).__name__)!r} drafts while decoding: on "
                             f"SGLang that runs as its NGRAM speculation (a GPU feature): set "
                             f"engine.speculative_algorithm=NGRAM, or use engine=torch_ref")
        self.last_engine = self.engine_for(drafter)
        engine = self.engine if self.last_engine == "plain" else self.spec_engine
        t0 = time.perf_counter()
        rows = [_Row(r, request_key64(sampling.seed, r)) for r in requests]
        for row in rows:
            drafter.start(row.request.key, row.request.prompt_token_ids)
        scoring = None
        if mode == "prefix":
            scoring = self._verify_prefix_drafts(engine, rows, sampling, drafter, verify, t0)
        if mode == "tree":
            self._feed_corpus(engine)
        self._continue(engine, rows, sampling, drafter, t0)
        out = []
        for row in rows:
            rollout = row.to_rollout()
            drafter.finish(row.request.key, rollout)
            if self.speculative == "NGRAM":
                self._history.append(list(row.request.prompt_token_ids) + rollout.token_ids)
            out.append(rollout)
        self.last_iterations = max(r.num_forward_passes for r in out)
        self.last_scoring = {"engine": self.last_engine, "scoring_logprobs": scoring,
                             "scoring_passes": sum(r.counters.num_scoring_passes for r in rows),
                             "scoring_tokens": sum(r.counters.num_scoring_tokens for r in rows)}
        return out

    def _check_prompt(self, r: Request, sampling: SamplingConfig) -> None:
        if not r.prompt_token_ids:
            raise ValueError(f"prompt {r.key.prompt_id!r} is empty: a rollout needs at least one prompt token")
        if len(r.prompt_token_ids) + sampling.max_new_tokens > self.info.max_context:
            raise ValueError(f"prompt {r.key.prompt_id!r} has {len(r.prompt_token_ids)} tokens; with max_new_tokens="
                             f"{sampling.max_new_tokens} that exceeds the model context of {self.info.max_context} "
                             f"({self.info.path}/config.json max_position_embeddings)")

    def _params(self, row: "_Row", sampling: SamplingConfig, max_new: int) -> dict:
        p = {"max_new_tokens": max_new, "temperature": sampling.temperature, "top_p": sampling.top_p,
             "top_k": sampling.top_k if sampling.top_k > 0 else -1, "sampling_seed": row.key64,
             "stop_token_ids": sorted(self._stops(sampling)), "skip_special_tokens": False}
        return p

    def _stops(self, sampling: SamplingConfig) -> set[int]:
        return set(self.info.eos_token_ids) | set(sampling.stop_token_ids)

    def _verify_prefix_drafts(self, engine, rows: list["_Row"], sampling: SamplingConfig, drafter: Drafter,
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
        if mode == "full":
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
        (raw at temperature 0), like the logprobs of a rollout."""
        logp = self._score_distributions(prompts, responses)
        if temperature not in (0, 1):
            logp = torch.log_softmax(logp / temperature, dim=-1)
        return [[float(logp[b, j, t]) for j, t in enumerate(r)] for b, r in enumerate(responses)]

    def _continue(self, engine, rows: list["_Row"], sampling: SamplingConfig, drafter: Drafter, t0: float) -> None:
        """Let SGLang sample the rest of every unfinished row in one batched call."""
        live = [row for row in rows if not row.finish_reason]
        if not live:
            return
        outs = engine.generate(
            input_ids=[list(row.request.prompt_token_ids) + row.output for row in live],
            sampling_params=[self._params(row, sampling, sampling.max_new_tokens - len(row.output)) for row in live],
            return_logprob=True)
        now = time.perf_counter() - t0
        stops = self._stops(sampling)
        for row, out in zip(live, outs):
            meta = out["meta_info"]
            tokens = [int(t) for t in out["output_ids"]]
            tokens = tokens[:cut_emitted(tokens, stops, sampling.max_new_tokens - len(row.output))]
            lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])][:len(tokens)]
            row.emit(tokens, lps, now)  # offline generate returns whole rollouts: times are when it returned
            drafter.observe(row.request.key, tokens)
            reason = (meta.get("finish_reason") or {}).get("type", "length")
            row.finish_reason = "stop" if reason == "stop" or (tokens and tokens[-1] in stops) else "length"
            verify_ct = int(meta.get("spec_verify_ct", 0) or 0)
            if verify_ct:  # NGRAM speculation: SGLang's own per-request counters
                row.counters.add(DraftCounters(
                    num_forward_passes=verify_ct, num_drafts=verify_ct,
                    num_draft_tokens=int(meta.get("spec_num_proposed_drafts", 0) or 0),
                    num_accepted_tokens=int(meta.get("spec_num_correct_drafts", 0) or 0),
                    num_accepted_tokens_per_pos=_per_pos_from_histogram(meta.get("spec_correct_drafts_histogram") or [],
                                                                         [])))
            else:  # plain decoding: one pass per token
                row.counters.record_plain(len(tokens))

    def _feed_corpus(self, engine) -> None:
        """Send rollouts finished since the last call to SGLang's NGRAM external corpus (global)."""
        new = self._history[self._corpus_loaded:]
        if not new:
            return
        from sglang.srt.managers.io_struct import AddExternalCorpusReqInput
        from sglang.srt.speculative.cpp_ngram.external_corpus import SEPARATOR_TOKEN
        chunks = [seq if i == 0 else [SEPARATOR_TOKEN] + seq for i, seq in enumerate(new)]
        req = AddExternalCorpusReqInput(corpus_id=f"specrollout-{self._corpus_loaded}", token_chunks=chunks)
        tm = engine.tokenizer_manager
        tm.auto_create_handle_loop()
        results = engine.loop.run_until_complete(tm.add_external_corpus_communicator(req))
        bad = [r.message for r in results if not r.success]
        if bad:
            raise RuntimeError(f"SGLang refused the NGRAM external corpus: {bad[0]}")
        self._corpus_loaded = len(self._history)


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


def _per_pos_from_histogram(hist: list[int], per_pos: list[int]) -> list[int]:
    """hist[k] = verify steps that accepted k draft tokens -> accepted count at each draft position."""
    out = list(per_pos)
    for k, count in enumerate(hist):
        for i in range(k):
            if i >= len(out):
                out.append(0)
            out[i] += int(count)
    return out


class _Row:
    """One rollout being assembled from a verified prefix and an SGLang continuation."""

    def __init__(self, request: Request, key64: int):
        self.request, self.key64 = request, key64
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.counters = DraftCounters()
        self.first_t = self.last_t = 0.0
        self.finish_reason = ""

    def emit(self, tokens: list[int], lps: list[float], first: float | None, last: float | None = None) -> None:
        if not tokens:
            return
        if not self.output and first is not None:
            self.first_t = first
        self.output += tokens
        self.logprobs += lps
        self.last_t = last if last is not None else first

    def to_rollout(self) -> Rollout:
        r = self.request
        return Rollout(key=r.key, step=r.step, prompt_token_ids=list(r.prompt_token_ids), token_ids=self.output,
                       logprobs=self.logprobs, finish_reason=self.finish_reason or "length",
                       **self.counters.as_dict(), first_token_time=self.first_t,
                       last_token_time=self.last_t, run_ahead=r.run_ahead)
