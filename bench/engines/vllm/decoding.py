"""The request paths of VLLMEngine (bench.engines.vllm.adapter): what ``rollout`` submits to vLLM
and how it reads the outputs back, as a mixin so the adapter's module keeps the engine's settings,
checkpoints and call order, and this one the requests.

    python -m pytest -m vllm tests/test_engine_vllm.py     (in the environment that has vLLM: bash .ci/engine-vllm.sh)

How each part of a method maps onto vLLM (vLLM's sampling is not coupled to the suite's, so
rollouts equal torch_ref's in distribution, not token for token):
- A draft proposed at output length 0 (prefix reuse, hybrid's first draft, a tree method's first
  draft) is verified by one scoring request over prompt + draft (``max_tokens=1``: the pass also
  yields the position after the draft) and the suite's rule (``bench.core.verify``). The request asks
  for what the rule needs (``bench.core.drafting.scoring_logprobs``): under greedy the top-1 and the
  draft token at each position; under ``ratio`` at temperature 1 the draft tokens' logprobs only
  (the token at the first rejection is then sampled by the continuation, the bonus of a fully
  accepted draft is the request's own sample); under ``exact`` at temperature > 0 the coupled
  inverse-CDF sample needs the whole distribution at every node, so the rule is read on vLLM's
  worker instead, by node requests (``bench.engines.vllm.node_reads``; nothing vocabulary-wide
  comes back): the first mismatch is emitted (a sample of p with the draft token excluded:
  lossless) or, all accepted, the bonus. The rest of the rollout is one generation request from
  prompt + emitted tokens with ``max_tokens = max_new_tokens - emitted``.
- SPEC-RL's scoring pass is accounted as on every engine (``bench.core.drafting.DraftCounters``): it
  is one of the rollout's forward passes (torch_ref verifies the same draft inside its prefill
  pass); what it cost on top is labelled per rollout row in ``num_scoring_passes`` /
  ``num_scoring_tokens`` and per call in ``last_scoring`` (requests, tokens, what logprobs).
- Methods that draft while decoding, where the suite verifies (``engine.spec_verify``: python, or
  auto at temperature > 0 on CPU), do not run here: ``VLLMEngine._scheduled`` runs them through
  the suite's one scheduler with vLLM as its backend (``bench.spec.node_backend.NodeBackend``).
- Otherwise drafts after the first token come from vLLM's ``custom_class`` proposer
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
  sampled token's raw logprob is used as is; at any other temperature the LLM without a
  speculative config reads each row's two log-partitions on the worker and rescales the raw
  logprob with them (``bench.engines.vllm.node_reads``, ``TEMPER``); only vLLM's speculative LLM,
  which takes no logits processor, still requests the whole raw distribution to rescale it.
- Counters per rollout: the scoring pass, then one per step the proposer saw (drafts, draft
  tokens, accepted, per position), all cut and counted by ``bench.core.drafting.settle``.
"""
from __future__ import annotations

import time

import torch

from methods.base import Drafter, Rollout

from bench.core.drafting import cut_emitted, settle, verify_from_logprobs
from bench.core.sampling import SamplingConfig
from bench.core.engine_protocol import request_key64
from bench.engines.vllm import proposer as vp
from bench.engines.vllm.inflight import InFlightRollout, StepLog
from bench.engines.vllm.node_reads import READS, TEMPER, node_verifier


class VLLMDecoding:
    """VLLMEngine's request paths (see the module docstring). A mixin: it uses the engine's ``info``,
    ``k``, ``max_num_seqs``, ``llm``, ``speculative``, ``_calls``, ``_fits``, ``last_iterations`` and
    ``last_iteration_log``, all set by VLLMEngine."""

    def _score_and_verify(self, llm, scored, sampling, verify, mode, stops, drafter, t0) -> None:
        """One scoring request per drafted row (logprobs as ``mode`` needs, see the module docstring),
        then the suite's rule (``bench.core.verify``) on what came back. ``full`` (the coupled rule at
        T > 0) is read on vLLM's worker by node requests (``bench.engines.vllm.node_reads``)."""
        from vllm import SamplingParams
        if mode == "full":
            verdicts, _ = node_verifier(self, self.node_llm()).verify(
                [list(row.request.prompt_token_ids) for row, _ in scored], [d for _, d in scored],
                [row.key64 for row, _ in scored], [0] * len(scored), sampling, verify)
            now = time.perf_counter() - t0
            for (row, d), v in zip(scored, verdicts):
                row.counters.record_scoring(len(row.request.prompt_token_ids) + len(d))
                self._emit(row, len(d), v.emitted, v.num_accepted, v.logprobs, stops, sampling, drafter, now)
            self._tell_finished([row for row, _ in scored], drafter)
            return
        items = []
        for i, (row, d) in enumerate(scored):
            if mode == "top1":
                params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, logprobs=0, detokenize=False)
            else:  # draft tokens only; the request's one sampled token is the bonus of a fully accepted draft
                params = SamplingParams(max_tokens=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                        top_k=sampling.top_k, prompt_logprobs=0, logprobs=0, detokenize=False,
                                        seed=(row.key64 ^ (len(d) << 1)) & ((1 << 63) - 1))
            items.append((f"s{self._calls}:{i}", row.request.prompt_token_ids + d.token_ids, params))
        outs = self._run(llm, items)
        now = time.perf_counter() - t0
        for (rid, ids, _), (row, d) in zip(items, scored):
            o, P, k = outs[rid], len(row.request.prompt_token_ids), len(d)
            plp, gen = o.prompt_logprobs, o.outputs[0]
            row.counters.record_scoring(len(ids))
            if mode == "top1":  # the argmax at each draft position, then vLLM's greedy token after the draft
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
        live: dict[str, InFlightRollout] = {}
        items = []
        for i, row in enumerate(rows):
            if not row.finish_reason:
                items.append(self._item(f"g{self._calls}:{i}", row, sampling, greedy, stops, session, live, llm))
        extra: list[InFlightRollout] = []
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
                self._admit_run_ahead(llm, run_ahead(free), sampling, drafter, greedy, stops, session, live, extra,
                                      pending_ahead)
            return False

        try:
            done = self._run(llm, items, on_output)
        finally:
            vp.REGISTRY.session = None
        self._take_outputs(live, done, session, sampling, greedy, stops)
        ahead = []
        for row in extra:
            ahead.append(row.to_rollout())
            if row.finished_gen:
                drafter.finish(row.request.key, ahead[-1])
        return ahead

    def _admit_run_ahead(self, llm, requests, sampling, drafter, greedy, stops, session, live, extra,
                         pending_ahead) -> None:
        """``_generate``'s run-ahead admission: each request that fits becomes a row (in ``extra``,
        told to the drafter) and a request added to the running engine (in ``pending_ahead``)."""
        from vllm.inputs import TokensPrompt
        for r in requests:
            if not self._fits(r, sampling):
                continue
            row = InFlightRollout(r, request_key64(sampling.seed, r))
            drafter.start(r.key, r.prompt_token_ids)
            extra.append(row)
            rid, ids, params = self._item(f"a{self._calls}:{len(extra)}", row, sampling, greedy, stops,
                                          session, live, llm)
            pending_ahead.add(rid)
            llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)

    def _take_outputs(self, live, done, session, sampling, greedy, stops) -> None:
        """``_generate``'s outputs into its rows: tokens cut at a stop or the room left, logprobs,
        finish reasons, counters (an aborted run-ahead row keeps the tokens it had)."""
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
            row.logprobs += self._logprobs(comp.logprobs, toks, sampling, greedy, READS.partitions.pop(rid, None))
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

    def _item(self, rid, row, sampling, greedy, stops, session, live, llm):
        from vllm import SamplingParams
        room = sampling.max_new_tokens - len(row.output)
        rescale = not greedy and sampling.temperature != 1.0
        on_worker = rescale and getattr(llm, "reads_on_worker", False)  # its processor reads the log-partitions
        params = SamplingParams(
            n=1, max_tokens=room, temperature=0.0 if greedy else sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, seed=(row.key64 ^ (len(row.output) << 1)) & ((1 << 63) - 1),
            stop_token_ids=sorted(stops), ignore_eos=False, logprobs=-1 if rescale and not on_worker else 0,
            detokenize=False, extra_args={TEMPER: rid} if on_worker else None)
        live[rid] = row
        if session is not None:
            session.add(rid, vp.RowState(row.request.key, list(row.output), sampling.max_new_tokens))
        return rid, row.request.prompt_token_ids + row.output, params

    def _logprobs(self, entries, toks, sampling, greedy, partitions=None) -> list[float]:
        """log_softmax(logits / T) of each token from vLLM's raw logprobs (see the module docstring);
        ``partitions``: output position -> (lse(z), lse(z / T)), read on the worker."""
        out = []
        for i, (tok, entry) in enumerate(zip(toks, entries or [])):
            if greedy or sampling.temperature == 1.0:
                out.append(float(entry[tok].logprob))
                continue
            if partitions is not None:
                if i not in partitions:
                    raise RuntimeError(f"vLLM sampled output position {i} without the logits processor seeing it; "
                                       f"its logprob cannot be rescaled to temperature {sampling.temperature}")
                lse, lse_t = partitions[i]
                out.append((float(entry[tok].logprob) + lse) / sampling.temperature - lse_t)
                continue
            raw = _dense([entry], self.info.vocab_size)[0].double()
            out.append(float(torch.log_softmax(raw / sampling.temperature, -1)[tok]))
        return out

    def _run(self, llm, items: list[tuple[str, list[int], object]], on_output=None, log: bool = True) -> dict[str, object]:
        """Submit (request id, token ids, SamplingParams) and step the engine until all finish;
        every ``engine.step()`` becomes a row of ``last_iteration_log`` (``StepLog``) unless ``log``
        is off (node requests: the scheduler logs their pass)."""
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
            step_log = StepLog()
            for o in outs:
                step_log.add(o, seen)
                if on_output is not None:
                    on_output(o)
                if o.finished:
                    done[o.request_id] = o
            stop = on_output is not None and on_output(None)  # the callback may end the loop (run-ahead)
            if log:
                self.last_iteration_log.append(step_log.row(self.last_iterations, live, budget, step_s,
                                                            time.perf_counter() - t_rest))
                self.last_iterations += 1
            if stop:
                break
        return done

    def _emit(self, row: InFlightRollout, draft_len: int, emitted: list[int], accepted: int, lps: list[float],
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
