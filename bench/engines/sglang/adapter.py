"""SGLang behind the Engine protocol, so methods can be compared on a production engine.

    python -m bench.harness.cli engine=sglang trace=countdown_tiny 'method=[baseline,prefix_reuse,prefix_reuse_exact]'
    python -m pytest -m sglang tests/test_engine_sglang.py   (CPU: in the rig venv, rigs/sglang_cpu/)

Four paths, chosen by the drafter (``bench.core.drafting.drafter_mode``), each on the engine
configuration it needs: baseline and prefix reuse (``engine.plain_engine_for``, default both) on
an ``sglang.Engine`` with NO speculative settings; tree methods on that engine through the
suite's scheduler, or, with ``speculative_algorithm=NGRAM``, on an NGRAM engine (GPU only; with
NGRAM set both engines run, each with ``mem_fraction_static`` of the device, 0.4 when unset).
``last_engine`` names the engine that served the last call, ``last_path`` whose loop ran it.
- baseline: ``engine.generate(input_ids=...)`` with return_logprob; SGLang samples. Each request
  carries its rollout key as ``sampling_seed``; SGLang honours it only with
  ``deterministic: true`` (enable_deterministic_inference, GPU attention backends), otherwise
  its sampler runs from ``random_seed``: reproducible in distribution, not per rollout.
- prefix reuse (a drafter that proposes its whole draft at output length 0): one scoring request
  per drafted row over prompt + draft, asking for what the rule needs, and the suite's rule on
  what comes back (``bench.engines.sglang.scoring``, whose docstring has the details); SGLang
  samples the rest of each unfinished row. The scoring request is one of the row's forward
  passes (torch_ref verifies the same draft inside its prefill); its cost is labelled in the
  rows' ``num_scoring_passes`` / ``num_scoring_tokens`` and per call in ``last_scoring``.
- any other drafter, without NGRAM (the default, and the only choice on CPU): the suite's one
  scheduler with SGLang as its backend (``bench.engines.sglang.node_reads``): every draft node a
  one-token request whose rule reading SGLang's scheduler computes with a custom logit processor;
  the same calls, counters, tokens (coupled) and iteration log as torch_ref, run-ahead included.
- any other drafter with ``speculative_algorithm=NGRAM``: SGLang's own NGRAM speculation (GPU
  only), fed with every earlier rollout (prompt + output) through its external corpus. This is
  the engine-native APPROXIMATION of the tree methods: one global trie across prompts (not per
  prompt), SGLang's drafts and its tree verification rather than the drafter's; the drafter is
  still told start/observe/finish so its statistics stay meaningful, and the counters come from
  SGLang's per-request meta_info.
``run_ahead`` runs on the scheduled path only (elsewhere SGLang owns its batch).

Cut and counters: every emitted token goes through ``bench.core.drafting.settle`` / ``cut_emitted``
(the stop/room cut of every engine) into a ``DraftCounters``. Logprobs: SGLang's output logprobs
are log_softmax(logits / T) (raw under greedy), as torch_ref returns them; its input-token
logprobs are raw (T = 1), so the full scoring path rescales them from the whole distribution.
Token times: offline generate returns whole rollouts, so a rollout's first/last token times are
when its call returned.

The package's modules: ``adapter`` (this one: the engine, its checkpoints, the call's phases and
SGLang's continuation), ``scoring`` (the prefix path's scoring requests and the rule's verdicts),
``node_reads`` (node requests read in SGLang's scheduler: the scheduled path and exact scoring),
``partial`` (a rollout being assembled).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from methods.base import Drafter, Rollout

from bench.core.drafting import DraftCounters, cut_emitted, drafter_mode, refuse_feature_readers
from bench.core.sampling import SamplingConfig
from bench.core.errors import UserError
from bench.core.verify import VerifyConfig, check_rule
from bench.core.engine_protocol import Request, RunAheadSource, request_key64
from bench.engines.checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint
from bench.engines.sglang.node_reads import node_backend
from bench.engines.sglang.partial import PartialRollout
from bench.engines.sglang.scoring import PrefixScoring
from bench.spec.policy import SpecPolicy
from bench.spec.scheduler import Scheduler, drain

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


class SGLangEngine(PrefixScoring):
    """``sglang.Engine`` over one checkpoint at a time; weights swapped in place between steps (the
    prefix path's scoring is ``PrefixScoring``'s, bench.engines.sglang.scoring)."""

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
                             f"that drafts while decoding runs on the scheduler or NGRAM), got {plain_engine_for!r}")
        self.device, self.dtype = device, dtype
        self.kwargs = dict(device=device, dtype=dtype, random_seed=random_seed, log_level=log_level,
                           enable_deterministic_inference=deterministic, skip_tokenizer_init=True,
                           enable_custom_logit_processor=True)  # node requests (bench.engines.sglang.node_reads)
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
        self.last_path = ""  # "scheduler" (the suite's loop, node requests verified here) or "sglang" (SGLang's)
        self._calls = 0
        self.policy = SpecPolicy("fixed")  # the scheduler's policy on the scheduled path
        self.last_scoring: dict = {}
        self.info: CheckpointInfo | None = None
        self._arch_key: str | None = None
        self._history: list[list[int]] = []  # finished rollouts (prompt + output) for the NGRAM corpus
        self._corpus_loaded = 0
        self.last_iterations = 0
        self.last_iteration_log: list[dict] | None = None  # the scheduled path's passes (torch_ref's columns)

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
        """Every request's rollout; ``run_ahead`` runs on the scheduled path only (on SGLang's own
        paths SGLang owns the batch, and NGRAM's approximation has no run-ahead rows)."""
        if (self.engine is None and self.spec_engine is None) or self.info is None:
            raise RuntimeError("SGLangEngine.rollout called before load(checkpoint)")
        check_rule(verify, sampling)
        refuse_feature_readers(drafter, "SGLang")
        if not requests:
            return []
        for r in requests:
            self._check_prompt(r, sampling)
        mode = drafter_mode(drafter)
        self._calls += 1
        if mode == "tree" and self.speculative != "NGRAM":
            return self._scheduled(requests, sampling, drafter, verify, run_ahead)
        self.last_engine, self.last_path = self.engine_for(drafter), "sglang"
        self.last_iteration_log = None  # SGLang's offline generate runs a batch to the end: no passes to log

        engine = self.engine if self.last_engine == "plain" else self.spec_engine
        t0 = time.perf_counter()
        rows = [PartialRollout(r, request_key64(sampling.seed, r)) for r in requests]
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

    def _scheduled(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter, verify: VerifyConfig,
                   run_ahead: RunAheadSource | None) -> list[Rollout]:
        """A method that drafts while decoding, without NGRAM: the suite's one scheduler
        (``bench.spec.scheduler``) with SGLang as its backend (``bench.engines.sglang.node_reads``):
        the calls, counters and iteration log of torch_ref, the coupled rule on SGLang's logits."""
        self.last_engine, self.last_path = "plain", "scheduler"  # without NGRAM the plain engine always exists
        backend = node_backend(self, self._calls)
        scheduler = Scheduler(backend, self.policy, len(requests))
        out = drain(scheduler.run(requests, sampling, drafter, verify, run_ahead))
        self.last_iterations, self.last_iteration_log = scheduler.iterations, scheduler.iteration_log
        self.last_scoring = {"engine": "plain", "scoring_logprobs": None, "scoring_passes": 0, "scoring_tokens": 0}
        return out

    def _fits(self, r: Request, sampling: SamplingConfig) -> bool:
        return len(r.prompt_token_ids) + sampling.max_new_tokens <= self.info.max_context

    def _check_prompt(self, r: Request, sampling: SamplingConfig) -> None:
        if not r.prompt_token_ids:
            raise ValueError(f"prompt {r.key.prompt_id!r} is empty: a rollout needs at least one prompt token")
        if len(r.prompt_token_ids) + sampling.max_new_tokens > self.info.max_context:
            raise ValueError(f"prompt {r.key.prompt_id!r} has {len(r.prompt_token_ids)} tokens; with max_new_tokens="
                             f"{sampling.max_new_tokens} that exceeds the model context of {self.info.max_context} "
                             f"({self.info.path}/config.json max_position_embeddings)")

    def _params(self, row: PartialRollout, sampling: SamplingConfig, max_new: int) -> dict:
        p = {"max_new_tokens": max_new, "temperature": sampling.temperature, "top_p": sampling.top_p,
             "top_k": sampling.top_k if sampling.top_k > 0 else -1, "sampling_seed": row.key64,
             "stop_token_ids": sorted(self._stops(sampling)), "skip_special_tokens": False}
        return p

    def _stops(self, sampling: SamplingConfig) -> set[int]:
        return set(self.info.eos_token_ids) | set(sampling.stop_token_ids)

    def _continue(self, engine, rows: list[PartialRollout], sampling: SamplingConfig, drafter: Drafter, t0: float) -> None:
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


def _per_pos_from_histogram(hist: list[int], per_pos: list[int]) -> list[int]:
    """hist[k] = verify steps that accepted k draft tokens -> accepted count at each draft position."""
    out = list(per_pos)
    for k, count in enumerate(hist):
        for i in range(k):
            if i >= len(out):
                out.append(0)
            out[i] += int(count)
    return out
