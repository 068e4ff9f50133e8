"""The torch reference engine: any Hugging Face causal LM, exact by construction, CPU or GPU.

Every iteration it asks each live rollout's drafter for a draft (empty, chain or tree, ragged
across the batch), runs ONE forward pass over all rows (tree attention by an additive 4D mask,
explicit positions), verifies with ``bench.core.verify``, keeps the KV of the accepted path only, and
feeds the emitted tokens back to the drafter. A speculation policy (``bench.spec.policy``) may cap
an iteration's draft budget; every forward pass is logged (``last_iteration_log``: its shape and
the seconds spent in the forward, the verifier and the drafter), the raw material of
``bench.spec.latency``. Example::

    eng = TorchRefEngine(); eng.load("ckpt_dir")
    rollouts = eng.rollout(requests, SamplingConfig(), Baseline(), VerifyConfig())
"""
from __future__ import annotations

import copy
import inspect
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from methods.base import Drafter, NullDrafter, Rollout

from bench.core.sampling import SamplingConfig
from bench.spec.prices import TablePrices
from bench.spec.scheduler import Scheduler, drain, policy_name
from bench.spec.policy import SpecPolicy
from bench.core.verify import VerifyConfig, check_rule
from bench.core.engine_protocol import Request, RunAheadSource
from bench.engines.checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint
from bench.engines.torch.kv_slots import SlotKVCache
from bench.engines.torch.block import Block, TorchBackend

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
SECONDS = ("measured", "table")  # engine.seconds: the clock, or every pass priced by the latency table


class TorchRefEngine:
    """Reference engine over transformers models with coupled sampling and the one verifier."""

    name = "torch_ref"

    def __init__(self, device: str = "cpu", dtype: str = "float32", attn_implementation: str = "sdpa",
                 max_batch_size: int | None = None, threads: int | None = None, spec_policy: str = "fixed",
                 spec_max_rows: int = 32, latency_table: str | None = None, seconds: str = "measured"):
        if dtype not in DTYPES:
            raise ValueError(f"engine.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if seconds not in SECONDS:
            raise ValueError(f"engine.seconds must be one of {list(SECONDS)}, got {seconds!r}")
        if seconds == "table" and latency_table is None:
            raise ValueError("engine.seconds=table prices every pass by engine.latency_table: set it to auto or a "
                             "CSV from python -m bench.benchmarks latency profile")
        self.seconds = seconds
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
        if (spec_policy == "throughput_optimal" or seconds == "table") and latency_table not in (None, "auto"):
            from bench.spec.latency import LatencyTable
            table = LatencyTable.read(latency_table)
        elif latency_table == "auto":
            table = "auto"  # profiled at the first load (bench.engines.torch.timing), once a model exists
        # the policy reads the table under throughput_optimal only (with it, fixed would split passes by it)
        self.policy = SpecPolicy(spec_policy, spec_max_rows, table if spec_policy == "throughput_optimal" else None)
        self.price_table = table if seconds == "table" else None  # what engine.seconds=table prices passes by

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
        if "auto" in (self.policy.table, self.price_table):
            from bench.engines.torch.timing import cached_latency_table
            table = cached_latency_table(self)
            self.policy.table = table if self.policy.table == "auto" else self.policy.table
            self.price_table = table if self.price_table == "auto" else self.price_table

    def _fp32_head(self) -> None:
        """In fp16/bf16, compute the output layer in fp32 (an fp32 copy of its weight, refreshed at
        every load): logits rounded to bf16 (8 mantissa bits) would make near-ties between a
        batched and a one-token forward far more common. Sampling reads fp32 logits whatever the
        model dtype (docs/design.md, "Coupled sampling"); costs vocab x hidden x 4 bytes of memory."""
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
        (``bench.core.verify.verify_nodes``). transformers' ``logits_to_keep`` takes a 2D bool mask of
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

    def policy_module(self):
        """The loaded policy (a transformers causal LM) for drafters that read it (``attach_policy``)."""
        if self.model is None:
            raise RuntimeError("TorchRefEngine.policy_module called before load(checkpoint)")
        return self.model

    def share_model(self, other: "TorchRefEngine") -> None:
        """Run ``other``'s loaded model (and its latency table, where this policy waits for one)."""
        for name in self._MODEL_STATE:
            if hasattr(other, name):
                setattr(self, name, getattr(other, name))
        if self.policy.table == "auto":
            self.policy.table = other.policy.table
        if self.price_table == "auto":
            self.price_table = other.price_table

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
        return drain(self.rollout_steps(requests, sampling, drafter, verify, run_ahead))

    def rollout_steps(self, requests: list[Request], sampling: SamplingConfig, drafter: Drafter,
                      verify: VerifyConfig, run_ahead: RunAheadSource | None = None):
        """``rollout`` one iteration at a time: a generator that yields after every iteration and
        returns the rollouts. The replay's interleaved timing (``bench.harness.replay``) advances the calls
        of several methods in turn, so that every method's iterations run at the same moments of a
        machine whose speed drifts. The call's clock (its rollouts' token times) counts only its own
        iterations. The loop itself is the scheduler's (``bench.spec.scheduler``); this engine is
        its backend (``TorchBackend``)."""
        if self.model is None or self.info is None:
            raise RuntimeError("TorchRefEngine.rollout called before load(checkpoint)")
        check_rule(verify, sampling)
        if not requests:
            return []
        for r in requests:
            self._check_prompt(r, sampling)
        prices = TablePrices(self.price_table) if self.price_table is not None else None
        scheduler = Scheduler(TorchBackend(self), self.policy, self.max_batch_size, prices=prices)
        self.last_iterations = 0  # forward passes of this call (what steps.parquet records)
        self.last_iteration_log = scheduler.iteration_log
        steps = scheduler.run(requests, sampling, drafter, verify, run_ahead)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                self.last_iterations = scheduler.iterations
                return done.value
            self.last_iterations = scheduler.iterations
            yield

    def policy_state(self, drafter: Drafter):
        """What the speculation policy carries into ``drafter``'s next call (``SpecPolicy.carried``):
        the replay's timing repeats start every repeat of a unit from it."""
        return self.policy.carried(policy_name(drafter))

    def restore_policy_state(self, drafter: Drafter, state) -> None:
        self.policy.restore_carried(policy_name(drafter), state)

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

    def _node_logits(self, block: "Block", cache: SlotKVCache):
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
        return self._head_at(block, hidden, head_s)

    def _head_at(self, block: "Block", hidden: torch.Tensor, head_s: list):
        """``logits_at`` over the hidden states of a block's positions (the output layer on demand)."""
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
        logits_at.features_at = lambda row, nodes: hidden[row, root[row] + nodes]  # drafters that read them
        return logits_at, head_s

    @property
    def _vocab(self) -> int:
        return getattr(self.model.get_output_embeddings(), "out_features", self.model.config.vocab_size)
