"""Exact verification on SGLang without full-vocabulary logprobs: node requests
(``bench.spec.node_backend``) read by an SGLang custom logit processor in its scheduler process.

    python -m pytest -m sglang tests/test_engine_sglang.py -k node     (CPU: in the rig venv, rigs/sglang_cpu/)

SGLang applies a request's custom logit processor (the engine started with
``enable_custom_logit_processor``) to the logits of the rows it samples, before its sampler and
its logprobs. ``NodeReadProcessor`` leaves the logits as they are and writes
``reads_from_logits``'s :class:`NodeRead` of each tagged row as a JSON line into the file its
request names: SGLang's scheduler runs in a process of its own on this machine, so the reads come
back through a file per batch of requests, which ``submit`` reads and removes once ``generate``
returned (the scheduler has written a row's line before it sends that row's output). The
processor is sent by reference (``to_str``: dill of an importable class), so the scheduler
process imports this module and the suite's verifier: the suite is installed in SGLang's venv.
SGLang's own sample of those requests is discarded.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from bench.core.verify import NodeRead
from bench.spec.node_backend import NodeBackend, NodeVerifier, reads_from_logits

FIELDS = ("rid", "key", "pos", "probes", "t", "top_p", "top_k", "greedy")  # node_tag's order


class NodeReadProcessor:
    """SGLang's custom logit processor protocol (``__call__(logits, custom_param_list)``,
    ``to_str``) without importing SGLang here."""

    def __call__(self, logits, custom_param_list=None):
        params = custom_param_list or []
        tagged = [(i, p) for i, p in enumerate(params) if isinstance(p, dict) and "rid" in p]
        if not tagged:
            return logits
        import torch
        rows = torch.tensor([i for i, _ in tagged], dtype=torch.int64, device=logits.device)
        reads = reads_from_logits(logits[rows], [[p[f] for f in FIELDS] for _, p in tagged])
        by_file: dict[str, list[str]] = {}
        for (_, p), rd in zip(tagged, reads):
            by_file.setdefault(p["out"], []).append(json.dumps(
                {"rid": p["rid"], "sampled": rd.sampled, "lp": rd.lp, "mg": rd.mg, "probe_lp": rd.probe_lp,
                 "probe_mg": rd.probe_mg}))
        for path, lines in by_file.items():
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
        return logits

    @classmethod
    def to_str(cls) -> str:
        import dill
        return json.dumps({"callable": dill.dumps(cls).hex()})


def sglang_submit(engine_of):
    """``submit`` for ``NodeVerifier``: one-token requests on the engine ``engine_of()`` returns."""
    processor = NodeReadProcessor.to_str()

    def submit(items: list[tuple[str, list[int], list]]) -> dict[str, NodeRead]:
        fd, out = tempfile.mkstemp(prefix="specrollout-nodes-", suffix=".jsonl")
        os.close(fd)
        try:
            params = [{"max_new_tokens": 1, "temperature": 0.0,
                       "custom_params": dict(zip(FIELDS, tag), out=out)} for _, _, tag in items]
            engine_of().generate(input_ids=[list(ids) for _, ids, _ in items], sampling_params=params,
                                 custom_logit_processor=[processor] * len(items))
            got = {}
            for line in Path(out).read_text(encoding="utf-8").splitlines():
                r = json.loads(line)
                got[r["rid"]] = NodeRead(r["sampled"], r["lp"], _num(r["mg"]), r["probe_lp"],
                                         [_num(x) for x in r["probe_mg"]])
            return got
        finally:
            os.unlink(out)

    return submit


def _num(x) -> float:
    return math.inf if x is None else float(x)


def node_verifier(engine, call: int) -> NodeVerifier:
    """A ``NodeVerifier`` on SGLang's plain engine (request ids unique within the call)."""
    return NodeVerifier(sglang_submit(lambda: engine.engine), engine.info.vocab_size, prefix=f"n{call}:")


def node_backend(engine, call: int) -> NodeBackend:
    """The scheduler's backend on SGLang."""
    return NodeBackend(node_verifier(engine, call), engine._stops, engine._fits)
