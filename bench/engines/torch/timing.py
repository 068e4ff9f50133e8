"""Timing the torch reference engine's own forward path for latency tables (``bench.spec.latency``).

    python -m bench.benchmarks latency profile --out table.csv

``time_forward`` runs the engine's real path (slot KV cache, ragged block, additive 4D mask,
explicit positions, the output layer on the verified nodes only) on synthetic rows: ``rows`` rows with ``context`` cached tokens each feed one
pending token plus a chain of ``query - 1`` draft tokens, for every query width over one prefill. ``cached_latency_table`` profiles a
small grid once per model architecture, dtype, thread count and machine and keeps it on disk, so
the ``throughput_optimal`` policy decides from the same table in every later run (each point's
fastest of 5 repeats, made monotone in rows and query: ``robust_seconds``).
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Protocol, Sequence

import torch

from methods.base import Draft, RolloutKey

from bench.core.engine_protocol import Request
from bench.engines.torch.kv_slots import SlotKVCache
from bench.spec.scheduler import LiveRow
from bench.engines.torch.block import Block
from bench.spec.latency import DEFAULT_CONTEXT
from bench.spec.latency import DEFAULT_QUERY
from bench.spec.latency import DEFAULT_ROWS
from bench.spec.roofline import ModelShape
import numpy as np
import pandas as pd

class TimedEngine(Protocol):
    """What timing reads of the engine it profiles (``TorchRefEngine``, which imports this module
    when it profiles its table: named here by what it offers, so the import runs one way)."""

    name: str
    model: Any
    info: Any
    device: torch.device
    dtype: torch.dtype
    _arch_key: str | None

    def _node_logits(self, block: Block, cache: SlotKVCache): ...

AUTO_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
AUTO_QUERY = (1, 2, 3, 5, 9, 17, 25)
AUTO_CONTEXT = (32, 256, 1024)  # the last clipped to what the model holds (``auto_contexts``)
TIMING_VERSION = 5  # bump when what a timed pass covers changes: cached tables are profiled again
AUTO_REPEATS = 5


def tree_parents(k: int) -> list[int]:
    """The tree draft a profile times: two chains from the root, of k // 2 and the rest (the tree
    drafters' drafts are mostly deep chains that branch near the root; the ancestor mask's cost
    follows the depth). Example: k = 5 -> [-1, 0, -1, 2, 3]."""
    first = k // 2
    return ([-1] + list(range(first - 1)) if first else []) + [-1] + list(range(first, k - 1))


def time_forward(engine: TimedEngine, rows: int, queries: Sequence[int], context: int,
                 repeats: int = 5, interleaved: bool = False, tree: bool = False) -> dict[int, list[float]]:
    """Seconds of ``repeats`` forward passes for each query width over one prefilled context,
    each width's passes one after another after an untimed one: {query: [seconds, ...]}.

    Back to back, not interleaved: an engine decoding plain passes repeats one shape, and a
    table of passes that each followed another shape put plain passes 20-40% above what the
    engine then measured (``predict``'s median error on two main-job runs 11.9-16.5% with
    interleaved widths, 2.3-8.9% back to back after an untimed grid point, results/LOG.md).
    A burst of load now hits several repeats of one width; the fastest repeat
    (``robust_seconds``) still discounts it.

    ``interleaved``: the widths in turn, every pass after one of another shape: the speculation
    policy's table (``cached_latency_table``). With it the main job's drafting methods measured
    1.09-1.31x under throughput_optimal (medians of 18 runs), with a back-to-back table
    1.06-1.21x (24 runs), results/LOG.md; the policy weighs plain passes against drafted ones,
    which in the engine follow passes of other shapes.

    ``tree``: each row's draft is a tree (``tree_parents``), so the block is built with its ancestor
    mask, as a tree drafter's passes are (``profile(trees=True)``)."""
    width = max(queries)
    gen = torch.Generator().manual_seed(rows * 1_000_003 + context)
    vocab = engine.model.config.vocab_size
    tokens = torch.randint(3, vocab, (rows, context + width), generator=gen).tolist()
    cache = SlotKVCache(capacity=context + width + 1)
    cache.add_rows(rows, context + width + 1)
    live = [LiveRow(Request(RolloutKey("profile", i), toks[:context]), 0, toks[:context], width) for i, toks in enumerate(tokens)]
    out: dict[int, list[float]] = {}
    with torch.inference_mode():
        _forward(engine, live, [Draft() for _ in live], cache)  # prefill the context (untimed)
        for row in live:
            row.cached, row.pending = context - 1, [row.pending[-1]]
        drafts = {q: [Draft(toks[context:context + q - 1], tree_parents(q - 1) if tree and q > 1 else None)
                      for toks in tokens] for q in queries}
        order = ([(rep, q) for rep in range(repeats + 1) for q in queries] if interleaved else
                 [(rep, q) for q in queries for rep in range(repeats + 1)])
        for rep, query in order:
            t = time.perf_counter()  # each pass rewrites the same slots past the context
            _forward(engine, live, drafts[query], cache)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            if rep:  # the first pass of each width is its warm-up
                out.setdefault(query, []).append(time.perf_counter() - t)
    return out


def _forward(engine: TimedEngine, rows: list[LiveRow], drafts: list[Draft], cache: SlotKVCache):
    """What an iteration's forward costs in the engine: the block, the model's base and the output
    layer on every real node (a draft of up to 32 nodes is read whole by the verifier's first window)."""
    block = Block.build(rows, drafts, cache, engine.device, engine.dtype)
    cache.set_block(block.write_index, block.view_len)
    logits_at, _ = engine._node_logits(block, cache)
    lens = torch.tensor([len(d) + 1 for d in drafts])
    row_idx = torch.arange(len(drafts)).repeat_interleave(lens)
    node_idx = torch.cat([torch.arange(n) for n in lens.tolist()])
    return logits_at(row_idx, node_idx)


def auto_contexts(max_context: int) -> tuple[int, ...]:
    """The context axis of the policy's table: ``AUTO_CONTEXT``, each clipped to what a model of
    ``max_context`` positions holds with the widest query (duplicates dropped).

    Why three points: the table is read in log space and extrapolates past its last context, and
    a pass's attention grows linearly in its context, faster for wide passes than for plain ones.
    With contexts 32 and 256 only, the main job's contexts (up to about 650) were predicted at
    0.69 of the measured seconds for passes of 4 rows x 5 or 9 tokens against 0.79 for plain
    ones (1 row x 9 tokens: 0.73 against 0.93), a bias that the policy's one scale for drafted
    passes cannot undo at every context (results/LOG.md)."""
    top = max(1, max_context - max(AUTO_QUERY) - 1)
    return tuple(sorted({min(c, top) for c in AUTO_CONTEXT}))


def cached_latency_table(engine: TimedEngine):
    """The engine's latency table for its loaded model on this machine, profiled on first use."""
    import pandas as pd

    from bench.spec.latency import LatencyTable
    from bench.core.paths import cache_root
    from bench.report.results import environment
    hw = environment()["hardware"]
    contexts = auto_contexts(engine.info.max_context)
    ident = "|".join([str(TIMING_VERSION), engine._arch_key or "", str(engine.dtype), str(torch.get_num_threads()),
                      str(hw.get("gpu") or hw.get("cpu")), engine.device.type, str(AUTO_ROWS),
                      str(AUTO_QUERY), str(contexts)])
    path = cache_root() / "latency" / f"torch_ref-{hashlib.sha1(ident.encode()).hexdigest()[:12]}.csv"
    if path.exists():
        return LatencyTable(pd.read_csv(path), str(path))
    frame = robust_seconds(profile(engine, AUTO_ROWS, AUTO_QUERY, contexts, repeats=AUTO_REPEATS, progress=False,
                                   interleaved=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    frame.to_csv(tmp, index=False)
    tmp.replace(path)
    return LatencyTable(frame, str(path))


def robust_seconds(frame):
    """The policy's table from a profile on a shared machine: each point's fastest repeat (other
    jobs only ever add time), then made monotone, since a pass of fewer rows or query tokens
    never costs more: seconds(r, q, c) = min over r' >= r, q' >= q of the fastest seconds (a slow
    outlier at a small shape is replaced, one at the largest shape stays). The scale of the
    machine's speed at run time is the policy's own measurement (``bench.spec.policy_costs``)."""
    out = frame.copy()
    out["seconds_median"] = out["seconds"]
    out["seconds"] = out["seconds_min"]
    for ctx, idx in out.groupby("context").groups.items():
        part = out.loc[idx].pivot_table(index="rows", columns="query", values="seconds")
        part = part.iloc[::-1, ::-1].cummin(axis=0).cummin(axis=1).iloc[::-1, ::-1]
        for i in idx:
            out.at[i, "seconds"] = float(part.at[out.at[i, "rows"], out.at[i, "query"]])
    return out


def profile(engine, rows: Sequence[int] = DEFAULT_ROWS, query: Sequence[int] = DEFAULT_QUERY,
            context: Sequence[int] = DEFAULT_CONTEXT, repeats: int = 5, progress: bool = True,
            interleaved: bool = False, trees: bool = False) -> pd.DataFrame:
    """Time the loaded engine's forward pass over the grid; one row per grid point (median).
    ``interleaved``: the widths timed in turn (the speculation policy's table), not back to back
    (``bench.engines.torch.timing.time_forward``). ``trees``: every point timed a second time with
    tree drafts (column ``tree`` 1; query 1 has no draft, so its tree row is the chain's)."""
    from tqdm.auto import tqdm

    from bench.report.results import environment
    grid = [(r, c) for r in rows for c in context]
    env = environment()
    hardware = env["hardware"].get("gpu") or env["hardware"].get("cpu", "?")
    cfg = engine.model.config
    shape = ModelShape.from_config(cfg.to_dict(), "profiled")
    out = []
    from bench.engines.torch.timing import time_forward
    if not interleaved:  # untimed: the grid's first shape, once, so the engine's one-time costs (allocator,
        # kernels chosen at a first call) land on no grid point; the first point measured 1.5x its neighbours
        time_forward(engine, grid[0][0], list(query), grid[0][1], repeats)
    for r, c in tqdm(grid, desc="latency profile", disable=not progress, unit="prefill"):
        for tree in ((False, True) if trees else (False,)):
            timed = time_forward(engine, r, list(query), c, repeats, interleaved, tree=tree)
            for q, times in timed.items():
                out.append({"rows": r, "query": q, "context": c, "seconds": float(np.median(times)),
                            "seconds_min": float(np.min(times)), "seconds_max": float(np.max(times)),
                            **({"tree": int(tree)} if trees else {})})
    frame = pd.DataFrame(out)
    frame["engine"] = engine.name
    frame["hardware"] = hardware
    frame["threads"] = _threads()
    frame["model"] = (f"{shape.layers}L h{shape.hidden} heads {shape.heads}/{shape.kv_heads} "
                      f"V{shape.vocab} ({shape.params / 1e6:.2f}M params)")
    frame["dtype"] = str(engine.dtype).replace("torch.", "")
    return frame


def _threads() -> int:
    import torch
    return torch.get_num_threads()
