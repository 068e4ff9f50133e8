"""SGLang behind the Engine protocol, so methods can be compared on a production engine.

    python -m bench.cli engine=sglang trace=countdown_tiny 'method=[baseline,prefix_reuse,prefix_reuse_exact]'
    python -m pytest -m sglang tests/test_engine_sglang.py   (CPU: in the rig venv, rigs/sglang_cpu/)

Three paths, chosen by the drafter:
- baseline: ``engine.generate(input_ids=...)`` with return_logprob; SGLang samples. Each request
  carries its rollout key as ``sampling_seed``; SGLang honours it only with
  ``deterministic: true`` (enable_deterministic_inference, GPU attention backends), otherwise
  its sampler runs from ``random_seed``: reproducible in distribution, not per rollout.
- prefix reuse (a drafter that proposes its whole draft at output length 0): one scoring request
  over prompt + draft + one filler token, ``max_new_tokens=0``, ``top_logprobs_num=V`` and
  ``logprob_start_len=len(prompt)-1`` (SGLang gives no logprob for the token AT the start index,
  so starting at len(prompt) would lose the first draft token's). That is the policy's full
  distribution at every draft position and, via the filler, at the bonus position; the rows go
  through ``bench.verify`` (the one verifier, exact or ratio, with the suite's coupled uniforms)
  and SGLang samples the rest of each unfinished row. Under ``exact`` this is lossless: the
  draft region is exact rejection sampling (accept x with probability p(x), else a sample of p
  without x), and even token-coupled with torch_ref; the continuation is SGLang's own sampling
  from p. Approximate only in the last bits: prefill vs decode float error, and the top-p/top-k
  boundary conventions of bench.sampling vs SGLang's sampler (ties, mass exactly at top_p).
  Cost: V logprobs per draft position, fine for small vocabularies, heavy for 150k-token ones.
- any other drafter: SGLang's own NGRAM speculation (GPU only), fed with every earlier rollout
  (prompt + output) through its external corpus. This is the engine-native APPROXIMATION of the
  tree methods: one global trie across prompts (not per prompt), SGLang's drafts and its tree
  verification rather than the drafter's; the drafter is still told start/observe/finish so its
  statistics stay meaningful, and the counters come from SGLang's per-request meta_info.
``run_ahead`` is not supported (SGLang owns its batch).

Logprobs: SGLang's output logprobs are log_softmax(logits / T) (raw under greedy), as torch_ref
returns them; its input-token logprobs are raw (T = 1), so the scoring path rescales them from
the full distribution. Token times: offline generate returns whole rollouts, so a rollout's
first/last token times are when its call returned.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from methods.base import Draft, Drafter, Rollout

from ..sampling import SamplingConfig
from ..errors import UserError
from ..verify import VerifyConfig, verify_batch
from .base import Request, RunAheadSource, request_key64
from .checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint

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


def drafter_mode(drafter: Drafter) -> str:
    """'baseline', 'prefix' (whole draft at output length 0) or 'tree' (drafts while decoding)."""
    from methods.baseline import Baseline
    from methods.base import NullDrafter
    from methods.prefix_reuse import PrefixReuseDrafter
    if isinstance(drafter, PrefixReuseDrafter):
        return "prefix"
    if type(drafter) in (Baseline, NullDrafter):
        return "baseline"
    return "tree"


class SGLangEngine:
    """``sglang.Engine`` over one checkpoint at a time; weights swapped in place between steps."""

    name = "sglang"

    def __init__(self, device: str = "cpu", dtype: str = "float32", attention_backend: str | None = None,
                 mem_fraction_static: float | None = None, random_seed: int = 0,
                 deterministic: bool = False, speculative_algorithm: str | None = None,
                 speculative_num_draft_tokens: int = 8, ngram_external_sam_budget: int = 8,
                 log_level: str = "error", extra_args: dict | None = None):
        if speculative_algorithm not in (None, "NGRAM"):
            raise ValueError(f"engine.speculative_algorithm must be null or NGRAM, got {speculative_algorithm!r}")
        self.device, self.dtype = device, dtype
        self.kwargs = dict(device=device, dtype=dtype, random_seed=random_seed, log_level=log_level,
                           enable_deterministic_inference=deterministic, skip_tokenizer_init=True)
        if attention_backend:
            self.kwargs["attention_backend"] = attention_backend
        if mem_fraction_static is not None:
            self.kwargs["mem_fraction_static"] = mem_fraction_static
        if speculative_algorithm == "NGRAM":
            self.kwargs.update(speculative_algorithm="NGRAM",
                               speculative_num_draft_tokens=speculative_num_draft_tokens,
                               speculative_ngram_external_sam_budget=ngram_external_sam_budget)
        self.kwargs.update(extra_args or {})
        self.speculative = speculative_algorithm
        self.engine = None
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
        if self.engine is not None and arch_key == self._arch_key:
            try:
                res = self.engine.update_weights_from_disk(str(info.path))
            except Exception as exc:
                raise CheckpointError(f"{info.path}: SGLang could not load these weights: {exc}") from exc
            ok, message = (res[0], res[1]) if isinstance(res, (tuple, list)) else (bool(res), "")
            if not ok and "flush" in str(message).lower():
                ok, message = self._flush_cache(), f"{message} (and flush_cache kept failing)"
            if not ok:
                raise CheckpointError(f"{info.path}: SGLang refused the weight update: {message}")
        else:
            self.close()
            sglang = import_sglang(self.device)
            try:
                self.engine = sglang.Engine(model_path=str(info.path), **self.kwargs)
            except Exception as exc:
                raise CheckpointError(f"{info.path}: SGLang could not start on this checkpoint with the engine "
                                      f"settings {self.kwargs}: {exc}") from exc
            self._corpus_loaded = 0  # a new engine has no corpus yet
        self.info, self._arch_key = info, arch_key

    def _flush_cache(self, tries: int = 100) -> bool:
        """Flush the prefix cache (stale KV of the old weights); the scheduler refuses while it still
        retires the last call's requests, so retry briefly."""
        for _ in range(tries):
            res = self.engine.flush_cache()
            if getattr(res, "success", res):
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # ------------------------------------------------------------------ rollouts
    def rollout(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                verify: VerifyConfig, run_ahead: RunAheadSource | None = None) -> list[Rollout]:
        """Every request's rollout; ``run_ahead`` is not supported (SGLang owns the batch)."""
        if self.engine is None or self.info is None:
            raise RuntimeError("SGLangEngine.rollout called before load(checkpoint)")
        if not requests:
            return []
        for r in requests:
            self._check_prompt(r, sampling)
        mode = drafter_mode(drafter)
        if mode == "tree" and self.speculative != "NGRAM":
            raise ValueError(f"method {getattr(drafter, 'name', type(drafter).__name__)!r} drafts while decoding: on "
                             f"SGLang that runs as its NGRAM speculation (a GPU feature): set "
                             f"engine.speculative_algorithm=NGRAM, or use engine=torch_ref")
        t0 = time.perf_counter()
        rows = [_Row(r, request_key64(sampling.seed, r)) for r in requests]
        for row in rows:
            drafter.start(row.request.key, row.request.prompt_token_ids)
        if mode == "prefix":
            self._verify_prefix_drafts(rows, sampling, drafter, verify, t0)
        if mode == "tree":
            self._feed_corpus()
        self._continue(rows, sampling, drafter, t0)
        out = []
        for row in rows:
            rollout = row.to_rollout()
            drafter.finish(row.request.key, rollout)
            if self.speculative == "NGRAM":
                self._history.append(list(row.request.prompt_token_ids) + rollout.token_ids)
            out.append(rollout)
        self.last_iterations = max(r.num_forward_passes for r in out)
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

    def _verify_prefix_drafts(self, rows: list["_Row"], sampling: SamplingConfig, drafter: Drafter,
                              verify: VerifyConfig, t0: float) -> None:
        """Score prompt + draft + filler in one batch, verify with bench.verify, emit the verdicts."""
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
            return
        logp = self._score_distributions([row.request.prompt_token_ids for row, _ in scored],
                                         [d.token_ids for _, d in scored])
        keys = torch.tensor([row.key64 for row, _ in scored], dtype=torch.int64)
        verdicts = verify_batch(logp, [d for _, d in scored], keys, [0] * len(scored), sampling, verify)
        now = time.perf_counter() - t0
        stops = self._stops(sampling)
        for (row, d), v in zip(scored, verdicts):
            emitted, lps = v.emitted, v.logprobs
            cut = next((i + 1 for i, t in enumerate(emitted) if t in stops), len(emitted))
            n = min(cut, sampling.max_new_tokens)
            emitted, lps = emitted[:n], lps[:n]
            accepted = min(v.num_accepted, len(emitted))
            row.drafts, row.draft_tokens, row.accepted = 1, len(d), accepted
            row.per_pos = [1] * accepted
            row.passes = 1
            row.emit(emitted, lps, now)
            drafter.observe(row.request.key, emitted)
            if emitted[-1] in stops:
                row.finish_reason = "stop"
            elif len(row.output) >= sampling.max_new_tokens:
                row.finish_reason = "length"

    def _score_distributions(self, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
        """[B, K, V] float64 raw log-softmax (temperature 1) of the policy at output positions
        0..len(response) of each row (the last one via a filler token); K = 1 + longest response,
        padding rows hold a uniform distribution."""
        vocab = self.info.vocab_size
        inputs = [list(p) + list(r) + [r[-1] if r else p[-1]] for p, r in zip(prompts, responses)]
        starts = [len(p) - 1 for p in prompts]
        outs = self.engine.generate(input_ids=inputs, sampling_params=[{"max_new_tokens": 0} for _ in inputs],
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

    def _continue(self, rows: list["_Row"], sampling: SamplingConfig, drafter: Drafter, t0: float) -> None:
        """Let SGLang sample the rest of every unfinished row in one batched call."""
        live = [row for row in rows if not row.finish_reason]
        if not live:
            return
        outs = self.engine.generate(
            input_ids=[list(row.request.prompt_token_ids) + row.output for row in live],
            sampling_params=[self._params(row, sampling, sampling.max_new_tokens - len(row.output)) for row in live],
            return_logprob=True)
        now = time.perf_counter() - t0
        for row, out in zip(live, outs):
            meta = out["meta_info"]
            tokens = [int(t) for t in out["output_ids"]]
            lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])][:len(tokens)]
            row.emit(tokens, lps, now)  # offline generate returns whole rollouts: times are when it returned
            drafter.observe(row.request.key, tokens)
            reason = (meta.get("finish_reason") or {}).get("type", "length")
            row.finish_reason = "stop" if reason == "stop" else "length"
            verify_ct = int(meta.get("spec_verify_ct", 0) or 0)
            row.passes += verify_ct or len(tokens)
            if verify_ct:  # NGRAM speculation: SGLang's own per-request counters
                hist = meta.get("spec_correct_drafts_histogram") or []
                row.drafts += verify_ct
                row.draft_tokens += int(meta.get("spec_num_proposed_drafts", 0) or 0)
                row.accepted += int(meta.get("spec_num_correct_drafts", 0) or 0)
                row.per_pos = _per_pos_from_histogram(hist, row.per_pos)

    def _feed_corpus(self) -> None:
        """Send rollouts finished since the last call to SGLang's NGRAM external corpus (global)."""
        new = self._history[self._corpus_loaded:]
        if not new:
            return
        from sglang.srt.managers.io_struct import AddExternalCorpusReqInput
        from sglang.srt.speculative.cpp_ngram.external_corpus import SEPARATOR_TOKEN
        chunks = [seq if i == 0 else [SEPARATOR_TOKEN] + seq for i, seq in enumerate(new)]
        req = AddExternalCorpusReqInput(corpus_id=f"specrollout-{self._corpus_loaded}", token_chunks=chunks)
        tm = self.engine.tokenizer_manager
        tm.auto_create_handle_loop()
        results = self.engine.loop.run_until_complete(tm.add_external_corpus_communicator(req))
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
        self.per_pos: list[int] = []
        self.drafts = self.draft_tokens = self.accepted = self.passes = 0
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
                       num_drafts=self.drafts, num_draft_tokens=self.draft_tokens,
                       num_accepted_tokens=self.accepted, num_accepted_tokens_per_pos=self.per_pos,
                       num_forward_passes=self.passes, first_token_time=self.first_t,
                       last_token_time=self.last_t, run_ahead=r.run_ahead)
