"""What the simulator reads: a trace directory (its recorded rollouts and prompts), or a folder of
run logs alone, as rollouts by step in the replay's row order.

    python -m bench.harness.simulate TRACE_DIR --method tree_cache     # a recorded trace
    python -m bench.harness.simulate LOG_DIR --method tree_cache       # a folder of run logs
    python -m bench.traces.importer ...                                # writes such a folder from an RL run's dump

A log folder holds one jsonl or parquet file per step named ``step_<N>`` (``step_00003.parquet``,
``step_3.jsonl``) with prompt_id, sample_idx, token_ids and optionally prompt_token_ids,
logprobs, reward.
"""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from bench.traces.format import iter_jsonl
from bench.harness.sim_methods import SimulationError

LOG_RE = re.compile(r"^step_?(\d+)\.(jsonl|parquet)$")
LOG_COLUMNS = ("prompt_id", "sample_idx", "token_ids")
LOG_LAYOUT = ("a trace directory (trace.yaml with recorded rollouts/step_XXXXX.parquet), or a folder "
              "of run logs: one file per step named step_<N>.jsonl or step_<N>.parquet "
              "(e.g. step_00003.parquet, step_3.jsonl) with prompt_id, sample_idx, token_ids and "
              "optional prompt_token_ids, logprobs, reward")


def load_input(path: str | Path) -> tuple[dict[int, pd.DataFrame], dict[str, list[int]], int | None]:
    """(rollouts by step, prompts, max_new_tokens or None) from a trace dir or a log folder."""
    root = Path(path)
    if not root.is_dir():
        raise SimulationError(f"{root} is not a directory; expected {LOG_LAYOUT}")
    from bench.traces.format import MANIFEST
    if (root / MANIFEST).exists():
        return _load_trace(root)
    return _load_logs(root)


def _load_trace(root: Path) -> tuple[dict[int, pd.DataFrame], dict[str, list[int]], int | None]:
    """A trace's recorded rollouts by step, its prompts and its max_new_tokens."""
    from bench.traces.format import MANIFEST, Trace, TraceError
    try:
        trace = Trace.load(root, validate=False)  # checkpoints are not needed: no model here
    except TraceError as exc:
        raise SimulationError(str(exc)) from exc
    steps = {}
    for s in trace.steps:
        if s.rollouts is not None:  # in the replay's row order: the step's prompts, then samples
            df = trace.rollouts(s.step)
            order = {p: i for i, p in enumerate(s.prompt_ids)}
            steps[s.step] = (df.assign(_order=df["prompt_id"].astype(str).map(order))
                             .sort_values(["_order", "sample_idx"], kind="stable")
                             .drop(columns="_order").reset_index(drop=True))
    if not steps:
        raise SimulationError(f"trace {root} records no rollouts (no step has a `rollouts` file in "
                              f"{root / MANIFEST}); simulation replays recorded rollouts: re-record "
                              f"the trace with rollouts or pass a folder of run logs")
    return steps, dict(trace.prompts), trace.sampling.max_new_tokens


def _load_logs(root: Path) -> tuple[dict[int, pd.DataFrame], dict[str, list[int]], None]:
    """A folder of per-step run logs: rollouts by step and the prompts the rows carry."""
    from bench.traces.format import MANIFEST
    files = {}
    for f in sorted(root.iterdir()):
        m = LOG_RE.match(f.name)
        if m:
            step = int(m.group(1))
            if step in files:
                raise SimulationError(f"{root}: step {step} has two log files ({files[step].name}, {f.name}); "
                                      f"keep one per step")
            files[step] = f
    if not files:
        raise SimulationError(f"{root} holds neither a trace (no {MANIFEST}) nor rollout logs (no "
                              f"step_<N>.jsonl / step_<N>.parquet files); expected {LOG_LAYOUT}")
    steps, prompts = {}, {}
    for step, f in sorted(files.items()):
        df = pd.read_parquet(f) if f.suffix == ".parquet" else _read_jsonl(f)
        missing = [c for c in LOG_COLUMNS if c not in df.columns]
        if missing:
            raise SimulationError(f"{f} lacks columns {missing}; each log row needs {list(LOG_COLUMNS)} "
                                  f"(optional: prompt_token_ids, logprobs, reward)")
        df = df.assign(prompt_id=df["prompt_id"].astype(str))
        if "prompt_token_ids" in df:
            for pid, ids in zip(df["prompt_id"], df["prompt_token_ids"]):
                if ids is not None and pid not in prompts:
                    prompts[pid] = [int(t) for t in ids]
        steps[step] = df
    return steps, prompts, None


def checkpoint_steps(path: str | Path) -> list[int] | None:
    """The steps a replay of the trace at ``path`` runs (those with a checkpoint); None for logs."""
    from bench.traces.format import MANIFEST, Trace
    root = Path(path)
    if not (root / MANIFEST).exists():
        return None
    return [s.step for s in Trace.load(root, validate=False).steps if s.checkpoint is not None]


def _read_jsonl(path: Path) -> pd.DataFrame:
    return pd.DataFrame.from_records([r for _, r in iter_jsonl(path, SimulationError)])
