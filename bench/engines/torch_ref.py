"""The torch reference engine: any Hugging Face causal LM, exact by construction, CPU or GPU.

Every iteration it asks each live rollout's drafter for a draft (empty, chain or tree, ragged
across the batch), runs ONE forward pass over all rows (tree attention by an additive 4D mask,
explicit positions), verifies with ``bench.verify``, keeps the KV of the accepted path only, and
feeds the emitted tokens back to the drafter. A speculation policy (``bench.spec_policy``) may cap
an iteration's draft budget; every forward pass is logged (``last_iteration_log``: its shape and
the seconds spent in the forward, the verifier and the drafter), the raw material of
``bench.latency``. Example::

    eng = TorchRefEngine(); eng.load("ckpt_dir")
    rollouts = eng.rollout(requests, SamplingConfig(), Baseline(), VerifyConfig())
"""
from __future__ import annotations

import copy
import inspect
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from methods.base import Draft, Drafter, NullDrafter, Rollout

from ..drafting import DraftCounters, drafter_mode, next_draft, report_live, settle
from ..sampling import SamplingConfig
from ..spec_policy import SpecPolicy
from ..verify import VerifyConfig, check_rule, verify_nodes
from .base import Request, RunAheadSource, request_key64
from .checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint
from .kv_slots import SlotKVCache

SPLIT_SAVING = 0.1  # two forward passes instead of one only where the latency table says they cost 10% less
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


@dataclass
class _Row:
    """A live rollout inside the engine loop."""

    request: Request
    key64: int
    pending: list[int]  # tokens whose KV is not yet in the cache (the prompt, then the last token)
    cached: int = 0  # valid KV slots [0, cached)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # signed margin of each output token (bench.verify)
    counters: DraftCounters = field(default_factory=DraftCounters)
    first_t: float = 0.0
    last_t: float = 0.0
    finish_reason: str = ""


class TorchRefEngine:
    """Reference engine over transformers models with coupled sampling and the one verifier."""

    name = "torch_ref"

    def __init__(self, device: str = "cpu", dtype: str = "float32", attn_implementation: str = "sdpa",
                 max_batch_size: int | None = None, threads: int | None = None, spec_policy: str = "fixed",
                 spec_max_rows: int = 32, latency_table: str | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"engine.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if threads is not None:  # process-wide: torch has one intra-op thread pool
            torch.set_num_threads(int(threads))
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.attn_implementation = attn_implementation
        self.max_batch_size = max_batch_size
        self.model = None
        self._base = None  # the model without its output layer (``_find_base``), None: the full forward
        self.info: CheckpointInfo | None = None
        self._arch_key: str | None = None
        self.last_iterations = 0
        self.last_iteration_log: list[dict] = []
        table = None
        if spec_policy == "throughput_optimal" and latency_table not in (None, "auto"):
            from ..latency import LatencyTable
            table = LatencyTable.read(latency_table)
        elif spec_policy == "throughput_optimal" and latency_table == "auto":
            table = "auto"  # profiled at the first load (bench.engines.torch_timing), once a model exists
        self.policy = SpecPolicy(spec_policy, spec_max_rows, table)

    # ------------------------------------------------------------------ checkpoints
    def load(self, checkpoint: str | Path) -> None:
        """Load a checkpoint; a checkpoint of the same architecture only swaps the weights."""
        info = inspect_checkpoint(Path(checkpoint))
        arch_key = json.dumps({k: v for k, v in info.config.to_dict().items()
                               if k not in ("_name_or_path", "transformers_version")}, sort_keys=True, default=str)
        if self.model is not None and arch_key == self._arch_key:
            from safetensors.torch import load_file
            state = {}
            for f in info.weight_files:
                state.update(load_file(str(f), device=str(self.device)))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or [m for m in missing if not self._is_tied(m)]:
                raise CheckpointError(f"{info.path}: weights do not match the loaded architecture "
                                      f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        else:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    str(info.path), dtype=self.dtype, attn_implementation=self.attn_implementation)
            except Exception as exc:  # transformers' own message, with the path in front
                raise CheckpointError(f"{info.path}: transformers could not load this checkpoint: {exc}") from exc
            self.model = model.to(self.device).eval()
            fwd = inspect.signature(self.model.forward).parameters
            self._cache_kw = "cache" if "cache" in fwd else "past_key_values"
            self._keep_kw = "logits_to_keep" if "logits_to_keep" in fwd else "num_logits_to_keep"
            self._base = None
        self._fp32_head()
        if self._base is None:
            self._base = self._find_base()
        self.info, self._arch_key = info, arch_key
        if self.policy.table == "auto":
            from .torch_timing import cached_latency_table
            self.policy.table = cached_latency_table(self)

    def _fp32_head(self) -> None:
        """In fp16/bf16, compute the output layer in fp32 (an fp32 copy of its weight, refreshed at
        every load): logits rounded to bf16 (8 mantissa bits) would make near-ties between a
        batched and a one-token forward far more common. Sampling reads fp32 logits whatever the
        model dtype (DESIGN.md section 1); costs vocab x hidden x 4 bytes of memory."""
        head = self.model.get_output_embeddings()
        if self.dtype not in (torch.float16, torch.bfloat16) or not isinstance(head, torch.nn.Linear):
            return
        weight = head.weight.detach().float()
        bias = None if head.bias is None else head.bias.detach().float()
        head.forward = lambda x: torch.nn.functional.linear(x.float(), weight, bias)

    def _find_base(self):
        """The model without its output layer, where ``output layer(base(x).last_hidden_state)`` is
        exactly the model's logits (checked on a probe input): the engine then runs the base and
        applies the output layer to the hidden states of the verified nodes only, chunk by chunk
        (``bench.verify.verify_nodes``). transformers' ``logits_to_keep`` takes a 2D bool mask of
        ragged positions, but computes all their logits at once (batch x draft x vocabulary for a
        4,096-token draft); models whose logits are more than the head of the hidden state (soft
        capping, scaling) fail the probe and keep the full forward (None)."""
        base = getattr(self.model, "base_model", None)
        head = self.model.get_output_embeddings()
        if base is None or base is self.model or head is None:
            return None
        fwd = inspect.signature(base.forward).parameters
        cache_kw = "cache" if "cache" in fwd else "past_key_values"
        if cache_kw not in fwd or "position_ids" not in fwd:
            return None
        ids = torch.tensor([[0, 1, 2, 1]], device=self.device) % self.model.config.vocab_size
        with torch.inference_mode():
            try:
                full = self.model(input_ids=ids, use_cache=False).logits
                hidden = base(input_ids=ids, use_cache=False).last_hidden_state
            except Exception:  # noqa: BLE001 - any failure means: keep the full forward
                return None
            if not torch.equal(head(hidden), full):
                return None
        self._base_cache_kw = cache_kw
        return base

    def _is_tied(self, name: str) -> bool:
        return name.startswith("lm_head") and bool(getattr(self.model.config, "tie_word_embeddings", False))

    def close(self) -> None:
        self.model = self._base = None

    _MODEL_STATE = ("model", "_base", "info", "_arch_key", "_cache_kw", "_keep_kw", "_base_cache_kw")

    def sibling(self) -> "TorchRefEngine":
        """An engine of the same settings that runs this one's model (no copy of the weights) with a
        speculation policy of its own: the replay's interleaved timing gives every method one, so
        that calls in flight together keep their per-call state apart. ``share_model`` after each
        ``load`` of this engine keeps it on the same weights."""
        twin = copy.copy(self)
        twin.policy = SpecPolicy(self.policy.kind, self.policy.max_rows, self.policy.table)
        twin.last_iterations, twin.last_iteration_log = 0, []
        return twin

    def share_model(self, other: "TorchRefEngine") -> None:
        """Run ``other``'s loaded model (and its latency table, where this policy waits for one)."""
        for name in self._MODEL_STATE:
            if hasattr(other, name):
                setattr(self, name, getattr(other, name))
        if self.policy.table == "auto":
            self.policy.table = other.policy.table

    # ------------------------------------------------------------------ rollouts
    def warm_up(self, requests: list[Request], sampling: SamplingConfig) -> None:
        """One untimed prefill of ``requests`` (one token each, no drafter) right before a timed
        rollout call: whatever ran since the last pass (a drafter fed 77 recorded steps, a
        collection) has left the caches cold, and the first pass of a unit measured up to 3x the
        warm one's seconds (results/LOG.md), a cost no method's clock should carry. Also off the
        clock: the speculation policy reads the last call's plain passes as its prior of the
        machine's speed now (``SpecPolicy.learn_plain_speed``)."""
        self.policy.learn_plain_speed(self.last_iteration_log)
        self.rollout(list(requests), replace(sampling, max_new_tokens=1), NullDrafter(), VerifyConfig())

    def rollout(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                verify: VerifyConfig, run_ahead: RunAheadSource | None = None) -> list[Rollout]:
        steps = self.rollout_steps(requests, sampling, drafter, verify, run_ahead)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def rollout_steps(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                      verify: VerifyConfig, run_ahead: RunAheadSource | None = None):
        """``rollout`` one iteration at a time: a generator that yields after every iteration and
        returns the rollouts. The replay's interleaved timing (``bench.replay``) advances the calls
        of several methods in turn, so that every method's iterations run at the same moments of a
        machine whose speed drifts (measured on this CPU: up to 30% within 150 ms, results/LOG.md).
        The call's clock (its rollouts' token times) counts only its own iterations, not the time
        spent between them."""
        if self.model is None or self.info is None:
            raise RuntimeError("TorchRefEngine.rollout called before load(checkpoint)")
        check_rule(verify, sampling)
        if not requests:
            return []
        stops = set(self.info.eos_token_ids) | set(sampling.stop_token_ids)
        for r in requests:
            self._check_prompt(r, sampling)
        target = self.max_batch_size or len(requests)
        waiting = list(requests)
        rows: list[_Row] = []
        done: dict[int, Rollout] = {}
        ahead: list[Rollout] = []
        order = {id(r): i for i, r in enumerate(requests)}
        cache = SlotKVCache(capacity=1)
        self.last_iterations = 0  # forward passes of this call (what steps.parquet records)
        self.last_iteration_log = []
        self.policy.start_call(_who(drafter))  # one drafter per method in a replay
        self._never_drafts = drafter_mode(drafter) == "baseline"  # no policy work for a drafter that never drafts
        t0 = time.perf_counter()
        while rows or waiting:
            with torch.inference_mode():  # entered per iteration: a generator must not hold it across its yields
                t_iter = time.perf_counter()
                drafter_s = 0.0
                free = target - len(rows)
                admitted = [waiting.pop(0) for _ in range(min(free, len(waiting)))]
                if run_ahead is not None and not waiting and free - len(admitted) > 0 and rows:
                    n = self.policy.run_ahead_rows(len(rows), free - len(admitted),
                                                   sum(r.cached + len(r.pending) for r in rows) / len(rows),
                                                   trained_rows=sum(not r.request.run_ahead for r in rows))
                    admitted += [r for r in run_ahead(n) if self._fits(r, sampling)] if n else []
                if admitted:
                    t_d = time.perf_counter()
                    for r in admitted:
                        drafter.start(r.key, r.prompt_token_ids)
                    drafter_s += time.perf_counter() - t_d
                    new = [_Row(r, request_key64(sampling.seed, r),
                                list(r.prompt_token_ids)) for r in admitted]
                    need = max(len(r.prompt_token_ids) for r in admitted) + sampling.max_new_tokens + 1
                    cache.add_rows(len(new), max(need, cache.capacity))
                    rows += new
                calls, iterate_drafter_s = self._iterate(rows, cache, sampling, drafter, verify, stops, t0)
                drafter_s += iterate_drafter_s
                keep = []
                for i, row in enumerate(rows):
                    if not row.finish_reason:
                        keep.append(i)
                        continue
                    rollout = self._to_rollout(row)
                    t_d = time.perf_counter()
                    drafter.finish(row.request.key, rollout)  # finished run-ahead rollouts feed caches too
                    drafter_s += time.perf_counter() - t_d
                    if row.request.run_ahead:
                        ahead.append(rollout)
                    else:
                        done[order[id(row.request)]] = rollout
                if len(keep) < len(rows):
                    rows = [rows[i] for i in keep]
                    cache.keep_rows(keep, used=max((r.cached for r in rows), default=0))
                total_s = time.perf_counter() - t_iter
                self._log_iteration(calls, drafter_s, total_s)
                fwd, ver = sum(c["forward_s"] for c in calls), sum(c["verify_s"] for c in calls)
                if self.policy.kind == "throughput_optimal" and not self._never_drafts:
                    shapes = [(c["rows"], c["block_tokens"] // c["rows"], c["query_tokens"], c["forward_s"],
                               "prefill" if prefill else "drafted" if c["draft_tokens"] else "plain")
                              for c, prefill in zip(calls, self._prefill_calls)]
                    self.policy.record_iteration(shapes, self._context_mean, ver, self._propose_s,
                                                 total_s - fwd - ver - (self._propose_s or 0.0))
                if rows and not waiting and all(r.request.run_ahead for r in rows):
                    for row in rows:  # the main batch is done: run-ahead rollouts are aborted
                        row.finish_reason = "abort"
                        ahead.append(self._to_rollout(row))
                    break
            paused = time.perf_counter()
            yield
            t0 += time.perf_counter() - paused  # the call's clock stops while other calls run
        # trained rollouts in request order, then run-ahead ones (finished or aborted) for the record
        return [done[i] for i in range(len(requests))] + ahead

    def policy_state(self, drafter: Drafter):
        """What the speculation policy carries into ``drafter``'s next call (``SpecPolicy.carried``):
        the replay's timing repeats start every repeat of a unit from it."""
        return self.policy.carried(_who(drafter))

    def restore_policy_state(self, drafter: Drafter, state) -> None:
        self.policy.restore_carried(_who(drafter), state)

    def _fits(self, r: Request, sampling: SamplingConfig) -> bool:
        return len(r.prompt_token_ids) + sampling.max_new_tokens <= self.info.max_context

    def _check_prompt(self, r: Request, sampling: SamplingConfig) -> None:
        if not r.prompt_token_ids:
            raise ValueError(f"prompt {r.key.prompt_id!r} is empty: a rollout needs at least one prompt token")
        if not self._fits(r, sampling):
            raise ValueError(
                f"prompt {r.key.prompt_id!r} has {len(r.prompt_token_ids)} tokens; with max_new_tokens="
                f"{sampling.max_new_tokens} that exceeds the model context of {self.info.max_context} "
                f"({self.info.path}/config.json max_position_embeddings): shorten the prompt or lower "
                f"sampling.max_new_tokens")

    def _iterate(self, rows: list[_Row], cache: SlotKVCache, sampling: SamplingConfig, drafter: Drafter,
                 verify: VerifyConfig, stops: set[int], t0: float) -> None:
        """One iteration: draft, build the ragged block(s), run the model, verify, commit.

        Returns one log entry per forward call (its shape and seconds) and the drafter's seconds."""
        contexts = [r.cached + len(r.pending) for r in rows]  # tokens each row's last token attends
        self._context_mean = sum(contexts) / len(rows)
        never = self._never_drafts and self.policy.kind != "fixed"
        cap = 0 if never else self.policy.budget(len(rows), self._context_mean)
        first = [not row.output for row in rows]  # a first draft is verified in its row's prefill
        t_d = time.perf_counter()
        if cap == 0 and not (any(first) and self.policy.first_drafts_decided and not never):
            drafts = [Draft() for _ in rows]  # the policy drafts nothing now: the drafter is not even asked (nor
            drafter_s = time.perf_counter() - t_d  # told the live batch: begin_iteration precedes proposals, here none)
            self._propose_s = None
        else:
            report_live(drafter, [(row.request.key, len(row.output)) for row in rows])
            drafts = [next_draft(drafter, row.request.key, row.output, sampling.max_new_tokens) for row in rows]
            drafter_s = time.perf_counter() - t_d
            if cap != 0:  # asked for the first drafts only when budget said 0: the others stay undrafted
                cap = self.policy.choose([d for d, f in zip(drafts, first) if not f], self._context_mean, cap)
            first_cap = self.policy.choose_first([d for d, f in zip(drafts, first) if f], len(rows),
                                                 max(len(r.pending) for r in rows), self._context_mean, cap)
            self._propose_s = time.perf_counter() - t_d  # what asking cost: the proposals and the choice over them
            if cap is not None or first_cap is not None:
                drafts = [d if c is None else d.truncated(c) for d, c in
                          zip(drafts, (first_cap if f else cap for f in first))]
        verdicts: list = [None] * len(rows)
        calls = []
        sizes = [len(r.pending) + len(d) for r, d in zip(rows, drafts)]
        lookup = self.policy.lookup  # None without a table (or "auto" before load)
        by_table = None if lookup is None else (lambda r, q: lookup.one(r, q, self._context_mean))
        for group in _forward_groups(sizes, seconds=by_table):
            t_f = time.perf_counter()
            g_rows, g_drafts = [rows[i] for i in group], [drafts[i] for i in group]
            block = _Block.build(g_rows, g_drafts, cache, self.device, self.dtype)
            subset = None if len(group) == len(rows) else torch.tensor(group, device=self.device)
            cache.set_block(block.write_index, block.view_len, subset)
            logits_at, head_s = self._node_logits(block, cache)
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # forward seconds are the model's, not the verifier's
            t_v = time.perf_counter()
            keys = torch.tensor([r.key64 for r in g_rows], dtype=torch.int64)
            for i, v in zip(group, verify_nodes(logits_at, self._vocab, g_drafts, keys, [len(r.output) for r in g_rows],
                                                sampling, verify, device=self.device)):
                verdicts[i] = v
            ctx = [contexts[i] for i in group]
            calls.append({"rows": len(group), "run_ahead_rows": sum(r.request.run_ahead for r in g_rows),
                          "query_tokens": sum(sizes[i] for i in group),
                          "block_tokens": int(block.input_ids.numel()), "context_sum": sum(ctx),
                          "context_max": max(ctx), "draft_tokens": sum(len(d) for d in g_drafts),
                          "draft_budget": -1 if cap is None else cap, "group": group,
                          "prefill": any(len(rows[i].pending) > 1 for i in group),
                          "forward_s": t_v - t_f + head_s[0], "verify_s": time.perf_counter() - t_v - head_s[0]})
        now = time.perf_counter() - t0
        accepted = [0] * len(rows)
        moves = []
        for b, (row, d, v) in enumerate(zip(rows, drafts, verdicts)):
            root_slot = row.cached + len(row.pending) - 1
            if any(p != i for i, p in enumerate(v.path)):
                moves.append((b, [root_slot + p for p in v.path], [root_slot + i for i in range(len(v.path))]))
            row.cached = root_slot + len(v.path)
            emitted, lps, mgs = v.emitted, v.logprobs, v.margins
            kept = settle(row.counters, len(d), emitted, v.num_accepted, stops, len(row.output),
                          sampling.max_new_tokens)  # the stop/room cut and the counters (bench.drafting)
            if kept.n < len(emitted):
                emitted, lps, mgs = emitted[:kept.n], lps[:kept.n], mgs[:kept.n]
            accepted[b] = kept.accepted
            if self.policy.kind == "throughput_optimal" and len(d):  # a first draft (output length 0, verified
                # in the prefill) is no evidence for the drafts of decoding: it has a tracker of its own
                self.policy.record(len(d), accepted[b], None if d.parents is None else
                                   [j - 1 for j in v.path[1:1 + accepted[b]]], d.parents, first=not row.output)
            if not row.output:
                row.first_t = now
            row.output += emitted
            row.logprobs += lps
            row.margins += mgs
            row.last_t = now
            row.pending = [emitted[-1]]
            t_d = time.perf_counter()
            drafter.observe(row.request.key, emitted)
            drafter_s += time.perf_counter() - t_d
            row.finish_reason = kept.finish_reason
        if moves:
            width = max(len(s) for _, s, _ in moves)
            src = torch.tensor([[cache.trash_slot] * width] * len(rows), dtype=torch.int64)
            dst = src.clone()
            for b, s, t in moves:
                src[b, :len(s)] = torch.tensor(s)
                dst[b, :len(t)] = torch.tensor(t)
            cache.move_slots(src.to(self.device), dst.to(self.device))
        self._prefill_calls = [call.pop("prefill") for call in calls]  # prompt tokens in the block (policy only)
        for call in calls:
            call["accepted_tokens"] = sum(accepted[i] for i in call.pop("group"))
        return calls, drafter_s

    def _node_logits(self, block: "_Block", cache: SlotKVCache):
        """Run the model on a block; returns ``logits_at(rows, nodes)`` for the verifier (the fp32
        logits of those (row, local node) pairs, the output layer applied to their hidden states
        only) and a one-item list that accumulates the seconds spent in the output layer (forward
        seconds, though the verifier calls it)."""
        head_s = [0.0]
        inputs = {"input_ids": block.input_ids, "position_ids": block.position_ids, "attention_mask": block.mask,
                  "use_cache": True}
        if self._base is None:  # the full forward: logits of the last K positions of every row
            out = self.model(**inputs, **{self._cache_kw: cache, self._keep_kw: block.keep})
            logits = out.logits
            index = block.node_index.to(logits.device)
            return (lambda rows, nodes: logits[rows.to(logits.device), index[rows.to(logits.device),
                                                                               nodes.to(logits.device)]]), head_s
        hidden = self._base(**inputs, **{self._base_cache_kw: cache}).last_hidden_state  # [b, q, H]
        head = self.model.get_output_embeddings()
        root = block.root_index.to(hidden.device)
        sync = self.device.type == "cuda"

        def logits_at(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            t = time.perf_counter()
            rows, nodes = rows.to(hidden.device), nodes.to(hidden.device)
            out = head(hidden[rows, root[rows] + nodes])
            if sync:
                torch.cuda.synchronize()
            head_s[0] += time.perf_counter() - t
            return out
        return logits_at, head_s

    @property
    def _vocab(self) -> int:
        return getattr(self.model.get_output_embeddings(), "out_features", self.model.config.vocab_size)

    def _log_iteration(self, calls: list[dict], drafter_s: float, total_s: float) -> None:
        """Append an iteration's forward calls to ``last_iteration_log`` (what iterations.parquet
        stores); the drafter's seconds and the rest of the iteration go on its first call."""
        live = sum(c["rows"] for c in calls)
        other = total_s - drafter_s - sum(c["forward_s"] + c["verify_s"] for c in calls)
        for j, call in enumerate(calls):
            call.update(iteration=self.last_iterations, call=j, live_rows=live,
                        drafter_s=drafter_s if j == 0 else 0.0, other_s=max(other, 0.0) if j == 0 else 0.0)
            self.last_iteration_log.append(call)
        self.last_iterations += 1

    @staticmethod
    def _to_rollout(row: _Row) -> Rollout:
        r = row.request
        return Rollout(key=r.key, step=r.step, prompt_token_ids=list(r.prompt_token_ids), token_ids=row.output,
                       logprobs=row.logprobs, margins=row.margins, finish_reason=row.finish_reason, **row.counters.as_dict(),
                       first_token_time=row.first_t, last_token_time=row.last_t, run_ahead=r.run_ahead, anticipates=r.anticipates)


@dataclass
class _Block:
    """The ragged input of one forward pass, left-padded so every row's nodes end the block.

    Row b feeds its pending tokens then its draft nodes; its local node j (0 = last pending
    token) sits at block index q - (1 + k_b) + j.
    """

    input_ids: torch.Tensor  # [B, q]
    position_ids: torch.Tensor  # [B, q]
    write_index: torch.Tensor  # [B, q] cache slot of each block position (padding -> trash slot)
    mask: torch.Tensor  # [B, 1, q, view_len] additive
    node_index: torch.Tensor  # [B, K] block index of local node j (K = keep)
    keep: int  # logits kept: the last K block positions
    view_len: int
    trash: int
    root_index: torch.Tensor | None = None  # [B] block index of local node 0 (node j at root + j)

    @classmethod
    def build(cls, rows: list[_Row], drafts: list[Draft], cache: SlotKVCache, device, dtype) -> "_Block":
        B = len(rows)
        sizes = [len(r.pending) + len(d) for r, d in zip(rows, drafts)]
        q, K = max(sizes), 1 + max(len(d) for d in drafts)
        trash = cache.trash_slot
        if q == 1:  # plain decoding, the common case: one token per row, no padding, no tree
            slot = torch.tensor([[r.cached] for r in rows])
            view_len = int(slot.max()) + 1
            allowed = torch.arange(view_len)[None, None, :] <= slot[:, :, None]
            mask = _additive(allowed, dtype)
            ids = torch.tensor([r.pending for r in rows])
            return cls(*_on(device, ids, slot, slot, mask, torch.zeros(B, 1, dtype=torch.int64)), 1, view_len, trash,
                       torch.zeros(B, dtype=torch.int64))
        chains = all(d.parents is None for d in drafts)
        ids, pos, slot, parent, node_index = [], [], [], [], []  # built as lists: one tensor each
        for row, d, s in zip(rows, drafts, sizes):
            n_p, k, off = len(row.pending), len(d), q - s
            ids.append([0] * off + row.pending + d.token_ids)
            slot.append([trash] * off + list(range(row.cached, row.cached + s)))
            node_index.append(list(range(K - k - 1, K)) + [0] * (K - k - 1))  # into the kept last K positions
            if chains:
                pos.append([0] * off + list(range(row.cached, row.cached + s)))
            else:
                par = [-1] + list(range(off, off + n_p - 1)) + [off + n_p + p for p in d.parent_list()]
                parent.append([-1] * off + par)
                depth = list(range(n_p)) + [n_p - 1 + x for x in _depths(d)]
                pos.append([0] * off + [row.cached + x for x in depth])
        ids, pos, slot = torch.tensor(ids), torch.tensor(pos), torch.tensor(slot)
        node_index = torch.tensor(node_index)
        view_len = int(max(r.cached + s for r, s in zip(rows, sizes)))
        real = slot != trash  # [B, q]
        cols = torch.arange(view_len)
        if chains:  # slots of a row are contiguous, so a query sees every slot up to its own
            allowed = (cols[None, None, :] <= slot[:, :, None]) & real[:, :, None]
        else:
            cached = torch.tensor([r.cached for r in rows])
            allowed = torch.cat([(cols[None, None, :] < cached[:, None, None]) & real[:, :, None],
                                 torch.zeros(B, q, 1, dtype=torch.bool)], 2)  # [B, q, view+1]
            # the block's own slots lie past every cached one; padding columns land in the spare last column
            slot_in_view = torch.where(real, slot, torch.full_like(slot, view_len))
            allowed.scatter_(2, slot_in_view[:, None, :].expand(B, q, q), _ancestors(torch.tensor(parent))
                             & real[:, None, :])
            allowed = allowed[..., :view_len]
        allowed[:, :, 0] |= ~real  # padding queries look at slot 0 only (never an empty softmax)
        mask = _additive(allowed, dtype)
        root = torch.tensor([q - 1 - len(d) for d in drafts])
        return cls(*_on(device, ids, pos, slot, mask, node_index), K, view_len, trash, root)


def _who(drafter: Drafter) -> str:
    """The speculation policy's name for a drafter: its class and identity (two methods of one
    class keep their evidence apart)."""
    return f"{type(drafter).__name__}@{id(drafter):x}"


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, q, L] bool -> [B, 1, q, L] additive attention mask (0 where allowed, dtype's min elsewhere)."""
    return torch.where(allowed[:, None], torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))


def _on(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tensors moved to the model's device (a no-op call still costs microseconds on CPU)."""
    return tensors if device.type == "cpu" else tuple(t.to(device) for t in tensors)


def _forward_groups(sizes: list[int], min_saving: float = 0.3, min_tokens: int = 64,
                    seconds=None) -> list[list[int]]:
    """Rows of one iteration split into one or two forward passes.

    A block is padded to its longest row, so a few long drafts make every row pay for them. With
    ``seconds(rows, width)`` (the latency table of this engine and model, as the speculation
    policy has it) two passes are run when they cost at least ``SPLIT_SAVING`` less than one by
    that table: on a CPU running a small model a pass costs about as much for 1 as for 3 tokens a
    row, so two passes cost twice one (measured: a 32-row iteration split 25 + 7 took 3.3 ms
    against 1.5 ms unsplit, results/LOG.md). Without a table, by tokens: when splitting the rows by
    block size at the best cut saves at least ``min_saving`` of the padded tokens (and the block is
    big enough for a second call to pay off). Example, by tokens: sizes [1, 1, 1, 25] ->
    [[0, 1, 2], [3]] (28 tokens instead of 100).
    """
    n, longest = len(sizes), max(sizes)
    if n < 2 or (seconds is None and n * longest < min_tokens):
        return [list(range(n))]
    order = sorted(range(n), key=sizes.__getitem__)
    ranked = [sizes[i] for i in order]
    cuts = [c for c in range(1, n) if ranked[c] != ranked[c - 1]]
    if not cuts:
        return [list(range(n))]
    if seconds is None:
        whole = n * longest
        best, cut = min((c * ranked[c - 1] + (n - c) * longest, c) for c in cuts)
        limit = (1 - min_saving) * whole
    else:
        whole = seconds(n, longest)
        best, cut = min((seconds(c, ranked[c - 1]) + seconds(n - c, longest), c) for c in cuts)
        limit = (1 - SPLIT_SAVING) * whole
    if best > limit:
        return [list(range(n))]
    return [sorted(order[:cut]), sorted(order[cut:])]


def _depths(d: Draft) -> list[int]:
    out: list[int] = []
    for p in d.parent_list():
        out.append(1 if p < 0 else out[p] + 1)
    return out


def _ancestors(parent: torch.Tensor) -> torch.Tensor:
    """[B, q] block-local parents -> [B, q, q] bool: query i may attend block position j."""
    B, q = parent.shape
    eye = torch.eye(q, dtype=torch.bool).expand(B, q, q).clone()
    out = eye.clone()
    cur = parent.clone()
    rows = torch.arange(B)[:, None]
    cols = torch.arange(q)[None, :].expand(B, q)
    while bool((cur >= 0).any()):
        valid = cur >= 0
        out[rows.expand(B, q)[valid], cols[valid], cur[valid]] = True
        cur = torch.where(valid, parent.gather(1, cur.clamp(min=0)), cur)
    return out
