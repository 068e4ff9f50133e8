"""Run folders that survive a killed run: atomic per-(step, method) parquet parts, resume, loading.

    python -m bench.report.collect results/runs      # reads what this module writes

Layout of ``<root>/<run-id>/`` (schemas in ``docs/results.md``)::

    config.yaml                      resolved config; a reopened run must have the same one
    summary.json                     versions, git sha, engine, hardware, start/end, status
    rollouts.parquet/step_00003__tree_cache.parquet   one part per finished (step, method)
    steps.parquet/step_00003__tree_cache.parquet
    iterations.parquet/step_00003__tree_cache.parquet   one row per engine forward pass of the unit
    drafters/step_00003__tree_cache.pkl   the method's drafter state after that unit (latest only)

A unit is committed by writing its rollouts and iterations parts, then its drafter snapshot, then its steps part,
each as a hidden temp file renamed into place with ``os.replace``. The steps part is the commit
marker: a unit whose steps part is missing is not done, its rollouts part and snapshot (if any)
are ignored on load and overwritten on resume, so nothing is lost or counted twice. A resumed
method starts from the snapshot of its last committed unit, so its drafts (and every counter)
are those of an uninterrupted run: the state is the one the run had, not a rebuild of it (not so
under ``engine.spec_policy=throughput_optimal``, whose decisions read measured seconds:
``bench.spec.policy``). Hidden temp files (``.tmp-*``) are skipped by
``pd.read_parquet(<dir>)`` and removed when a writer reopens the folder.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping
from urllib.parse import quote, unquote

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from methods.base import Rollout

from bench.core.errors import UserError

ROLLOUT_SCHEMA: dict[str, pa.DataType] = {
    "run_id": pa.string(), "trace": pa.string(), "engine": pa.string(), "method": pa.string(),
    "step": pa.int64(), "prompt_id": pa.string(), "sample_idx": pa.int64(),
    "prompt_len": pa.int64(), "output_len": pa.int64(),
    "output_tokens": pa.list_(pa.int64()), "logprobs": pa.list_(pa.float64()),
    "finish_reason": pa.string(), "num_drafts": pa.int64(), "num_draft_tokens": pa.int64(),
    "num_accepted_tokens": pa.int64(), "num_accepted_tokens_per_pos": pa.list_(pa.int64()),
    "num_forward_passes": pa.int64(), "first_token_s": pa.float64(), "last_token_s": pa.float64(),
    "run_ahead": pa.bool_(), "anticipates_step": pa.int64(), "reward": pa.float64(), "matches_recorded": pa.bool_(),
    "margins": pa.list_(pa.float64()),
}
STEP_SCHEMA: dict[str, pa.DataType] = {
    "run_id": pa.string(), "trace": pa.string(), "engine": pa.string(), "method": pa.string(),
    "step": pa.int64(), "num_rollouts": pa.int64(), "wall_s": pa.float64(),
    "output_tokens": pa.int64(), "tokens_per_s": pa.float64(), "forward_passes": pa.int64(),
    "num_drafts": pa.int64(), "num_draft_tokens": pa.int64(), "num_accepted_tokens": pa.int64(),
    "reward_mean": pa.float64(), "recorded_match_rate": pa.float64(),
    "cache_entries": pa.int64(), "cache_bytes": pa.int64(),
}
DRAFTER_PREFIX = "drafter_"  # drafter stats in steps rows: drafter_<name>, always float64
ITERATION_SCHEMA: dict[str, pa.DataType] = {
    "run_id": pa.string(), "method": pa.string(), "step": pa.int64(), "iteration": pa.int64(),
    "call": pa.int64(), "rows": pa.int64(), "live_rows": pa.int64(), "run_ahead_rows": pa.int64(),
    "query_tokens": pa.int64(), "block_tokens": pa.int64(), "context_sum": pa.int64(),
    "context_max": pa.int64(), "draft_tokens": pa.int64(), "accepted_tokens": pa.int64(),
    "draft_budget": pa.int64(), "forward_s": pa.float64(), "verify_s": pa.float64(),
    "drafter_s": pa.float64(), "other_s": pa.float64(), "tree_block": pa.bool_(),
    "nodes_read": pa.int64(),
    # a learned drafter's own passes (bench.drafters.model_passes), on an iteration's first pass; null for others
    "drafter_model_s": pa.float64(), "drafter_model_passes": pa.int64(), "drafter_window_bytes": pa.float64(),
    "drafter_window_flops": pa.float64(), "drafter_step_bytes": pa.float64(), "drafter_step_flops": pa.float64(),
}
ROLLOUTS_DIR, STEPS_DIR, DRAFTERS_DIR = "rollouts.parquet", "steps.parquet", "drafters"
ITERATIONS_DIR = "iterations.parquet"
_TMP_PREFIX = ".tmp-"


class ConfigMismatchError(UserError, ValueError):
    """A run folder was reopened with a config different from the one it was started with."""


class RunFolderError(UserError, FileNotFoundError):
    """A path is not a (complete) run folder."""


def rollout_row(rollout: Rollout, **extra: Any) -> dict:
    """One rollouts.parquet row from an engine's Rollout; ``extra`` adds or overrides columns
    (run_id, trace, engine, method, reward, matches_recorded, ...)."""
    row = {
        "step": rollout.step, "prompt_id": rollout.key.prompt_id,
        "sample_idx": rollout.key.sample_idx, "prompt_len": len(rollout.prompt_token_ids),
        "output_len": len(rollout.token_ids), "output_tokens": list(rollout.token_ids),
        "logprobs": [float(x) for x in rollout.logprobs], "finish_reason": rollout.finish_reason,
        "num_drafts": rollout.num_drafts, "num_draft_tokens": rollout.num_draft_tokens,
        "num_accepted_tokens": rollout.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(rollout.num_accepted_tokens_per_pos),
        "num_forward_passes": rollout.num_forward_passes,
        "first_token_s": rollout.first_token_time, "last_token_s": rollout.last_token_time,
        "run_ahead": rollout.run_ahead, "anticipates_step": rollout.anticipates, "reward": None, "matches_recorded": None,
        "margins": [float(x) for x in rollout.margins],
    }
    row.update(extra)
    return row


def step_row(rollout_rows: list[dict], wall_s: float, forward_passes: int,
             cache_entries: int | None = None, cache_bytes: int | None = None,
             drafter_stats: Mapping[str, float] | None = None, **extra: Any) -> dict:
    """A steps.parquet row summing a unit's rollout rows (run-ahead rollouts excluded);
    ``forward_passes`` is the engine's iteration count for the step, ``extra`` adds columns."""
    rows = [r for r in rollout_rows if not r.get("run_ahead")]
    out_tokens = sum(r["output_len"] for r in rows)
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    matches = [bool(r["matches_recorded"]) for r in rows if r.get("matches_recorded") is not None]
    row = {
        "num_rollouts": len(rows), "wall_s": float(wall_s), "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / wall_s if wall_s > 0 else float("nan"),
        "forward_passes": forward_passes,
        **{k: sum(r[k] for r in rows) for k in
           ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "recorded_match_rate": sum(matches) / len(matches) if matches else None,
        "cache_entries": cache_entries, "cache_bytes": cache_bytes,
    }
    for name, value in (drafter_stats or {}).items():
        row[DRAFTER_PREFIX + name] = value
    row.update(extra)
    return row


def _part_name(step: int, method: str) -> str:
    return f"step_{int(step):05d}__{quote(method, safe='-_.')}.parquet"


def _parse_part(name: str) -> tuple[int, str] | None:
    if name.startswith((".", "_")) or not name.startswith("step_") or not name.endswith(".parquet"):
        return None
    step, _, method = name[len("step_"):-len(".parquet")].partition("__")
    return (int(step), unquote(method)) if step.isdigit() and method else None


def _to_table(rows: list[dict], schema: Mapping[str, pa.DataType], float_prefix: str = "") -> pa.Table:
    names = list(schema) + sorted({k for r in rows for k in r} - set(schema))
    arrays = []
    for name in names:
        values = [r.get(name) for r in rows]
        kind = schema.get(name) or (pa.float64() if float_prefix and name.startswith(float_prefix)
                                    else None)
        try:
            arrays.append(pa.array(values, type=kind))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:
            raise ValueError(f"column {name!r}: cannot store {values[:3]!r}... as "
                             f"{kind or 'one type'} ({err})") from err
    return pa.table(dict(zip(names, arrays)))


def _atomic_write_bytes(path: Path, write) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{os.getpid()}-{path.name}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write_bytes(path, lambda f: f.write(text.encode()))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, Mapping) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _normalize(config: Any) -> dict:
    if not isinstance(config, Mapping):  # an OmegaConf DictConfig
        from omegaconf import OmegaConf
        config = OmegaConf.to_container(config, resolve=True)
    return yaml.safe_load(yaml.safe_dump(dict(config), sort_keys=True))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def environment() -> dict:
    """Versions, git sha and hardware of this process, for summary.json."""
    versions = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "vllm", "sglang"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    git: dict[str, Any] = {}
    try:
        here = Path(__file__).resolve().parent
        run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True, text=True,
                                        timeout=10)
        sha = run("rev-parse", "HEAD")
        if sha.returncode == 0:
            git = {"sha": sha.stdout.strip(), "dirty": bool(run("status", "--porcelain").stdout)}
    except (OSError, subprocess.SubprocessError):
        pass
    hardware: dict[str, Any] = {"cpu": platform.processor() or platform.machine(),
                                "cores": os.cpu_count(), "platform": platform.platform()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                hardware["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # importing torch costs seconds: only where it is loaded already or a GPU driver exists
    if "torch" in versions and ("torch" in sys.modules or shutil.which("nvidia-smi")):
        try:
            import torch
            if torch.cuda.is_available():
                hardware["gpu"] = torch.cuda.get_device_name(0)
                hardware["gpu_count"] = torch.cuda.device_count()
        except Exception:  # a broken CUDA install must not stop a run from recording
            pass
    return {"versions": versions, "git": git, "hardware": hardware}


class RunWriter:
    """Creates or reopens ``run_dir`` and appends one (step, method) unit at a time, atomically."""

    def __init__(self, run_dir: str | Path, config: Mapping, summary: Mapping | None = None,
                 not_identity: Iterable[str] = ()):
        """``not_identity``: top-level config keys a reopened run may change (output folders,
        verbosity); the config saved when the folder is created records them all the same."""
        self.run_dir = Path(run_dir)
        self.config = _normalize(config)
        self.rollouts_dir = self.run_dir / ROLLOUTS_DIR
        self.steps_dir = self.run_dir / STEPS_DIR
        self.drafters_dir = self.run_dir / DRAFTERS_DIR
        self.iterations_dir = self.run_dir / ITERATIONS_DIR
        config_path, summary_path = self.run_dir / "config.yaml", self.run_dir / "summary.json"
        if config_path.exists():
            self._check_same_config(config_path, tuple(not_identity))
            old = json.loads(summary_path.read_text()) if summary_path.exists() else {}
            self.summary = {**old, **(summary or {}), "status": "running"}
            self.summary.setdefault("resumed_at", []).append(_now())
            self._clean()
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _atomic_write_text(config_path, yaml.safe_dump(self.config, sort_keys=False))
            self.summary = {"run_id": self.run_dir.name, **environment(), **(summary or {}),
                            "start_time": _now(), "end_time": None, "status": "running"}
            engine = self.config.get("engine")
            if "engine" not in self.summary and engine is not None:
                self.summary["engine"] = engine.get("name") if isinstance(engine, Mapping) else engine
        self.run_id = str(self.summary.get("run_id") or self.run_dir.name)
        self.rollouts_dir.mkdir(exist_ok=True)
        self.steps_dir.mkdir(exist_ok=True)
        self.drafters_dir.mkdir(exist_ok=True)
        self.iterations_dir.mkdir(exist_ok=True)
        self._write_summary()

    def _check_same_config(self, path: Path, not_identity: tuple[str, ...] = ()) -> None:
        old = _flatten(yaml.safe_load(path.read_text()) or {})
        new = _flatten(self.config)
        skip = lambda k: any(k == top or k.startswith(f"{top}.") for top in not_identity)
        diff = sorted(k for k in old.keys() | new.keys()
                      if not skip(k) and old.get(k, "<absent>") != new.get(k, "<absent>"))
        if diff:
            shown = ", ".join(f"{k} ({old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r})"
                              for k in diff[:10])
            raise ConfigMismatchError(
                f"{self.run_dir} was started with a different config; differing keys: {shown}"
                f"{' ...' if len(diff) > 10 else ''}. To resume it, use the same config; "
                f"to run this config, give it a new run id (a new folder).")

    def _clean(self) -> None:
        """Remove temp files of a killed writer, and rollouts parts and drafter snapshots of
        uncommitted units."""
        done = {p.name for p in self.steps_dir.glob("step_*.parquet")}
        for d in (self.rollouts_dir, self.steps_dir, self.drafters_dir, self.iterations_dir):
            for p in d.glob(f"{_TMP_PREFIX}*"):
                p.unlink(missing_ok=True)
        for p in [*self.rollouts_dir.glob("step_*.parquet"), *self.iterations_dir.glob("step_*.parquet")]:
            if p.name not in done:
                p.unlink(missing_ok=True)
        for p in self.drafters_dir.glob("step_*.pkl"):
            if p.with_suffix(".parquet").name not in done:
                p.unlink(missing_ok=True)

    def _write_summary(self) -> None:
        _atomic_write_text(self.run_dir / "summary.json",
                           json.dumps(self.summary, indent=2, default=str) + "\n")

    def done_units(self) -> set[tuple[int, str]]:
        """(step, method) units already committed; a resumed run skips these."""
        return {u for p in self.steps_dir.iterdir() if (u := _parse_part(p.name))}

    def write_unit(self, step: int, method: str, rollout_rows: list[dict], step_row: dict,
                   drafter_state: bytes | None = None, iteration_rows: list[dict] | None = None) -> None:
        """Commit one finished unit (rewriting a done unit replaces it, never duplicates it);
        ``drafter_state`` (a pickled drafter, see :meth:`drafter_state`) and the engine's
        ``iteration_rows`` (one per forward pass) are committed with it."""
        ids = {"run_id": self.run_id, "step": int(step), "method": method}
        for row in [*rollout_rows, step_row]:
            for k in ("step", "method"):
                if k in row and row[k] != ids[k]:
                    raise ValueError(f"write_unit(step={step}, method={method!r}) got a row with "
                                     f"{k}={row[k]!r}; a unit holds one step of one method")
        common = {k: step_row[k] for k in ("trace", "engine") if k in step_row}
        rollouts = _to_table([{**common, **ids, **r} for r in rollout_rows], ROLLOUT_SCHEMA)
        steps = _to_table([{**ids, **step_row}], STEP_SCHEMA, float_prefix=DRAFTER_PREFIX)
        name = _part_name(step, method)
        _atomic_write_bytes(self.rollouts_dir / name, lambda f: pq.write_table(rollouts, f))
        if iteration_rows is not None:
            table = _to_table([{**r, **ids} for r in iteration_rows], ITERATION_SCHEMA)
            _atomic_write_bytes(self.iterations_dir / name, lambda f: pq.write_table(table, f))
        snapshot = self.drafters_dir / Path(name).with_suffix(".pkl")
        if drafter_state is not None:
            _atomic_write_bytes(snapshot, lambda f: f.write(drafter_state))
        _atomic_write_bytes(self.steps_dir / name, lambda f: pq.write_table(steps, f))
        for old in self.drafters_dir.glob("step_*.pkl"):  # only the latest state is ever resumed from
            unit = _parse_part(old.with_suffix(".parquet").name)
            if unit is not None and unit[1] == method and unit[0] < int(step):
                old.unlink(missing_ok=True)

    def drafter_state(self, step: int, method: str) -> bytes | None:
        """The drafter snapshot committed with unit (step, method), or None if there is none."""
        path = self.drafters_dir / Path(_part_name(step, method)).with_suffix(".pkl")
        return path.read_bytes() if path.exists() else None

    def finish(self, status: str = "complete") -> None:
        """Mark the run finished (status and end time in summary.json)."""
        self.summary.update(status=status, end_time=_now())
        self._write_summary()


def _read_part(path: Path) -> pd.DataFrame:
    """One parquet part; an unreadable one raises RunFolderError naming it and the fix."""
    try:
        return pd.read_parquet(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        run_dir, name = path.parent.parent, path.name
        raise RunFolderError(
            f"{path} is not a readable parquet file ({type(exc).__name__}: {exc}). Delete "
            f"{run_dir / STEPS_DIR / name} and {run_dir / ROLLOUTS_DIR / name}: rerunning the run's "
            f"command recomputes that (step, method) unit, and collect works without it.") from exc


def check_parts(run_dir: str | Path) -> None:
    """Read every committed part of a run folder (raises RunFolderError on the first bad one):
    called before a run folder is reopened, so a corrupt part is reported before anything changes."""
    run_dir = Path(run_dir)
    if not (run_dir / STEPS_DIR).is_dir():
        return
    for name in sorted(p.name for p in (run_dir / STEPS_DIR).iterdir() if _parse_part(p.name)):
        for directory in (STEPS_DIR, ROLLOUTS_DIR):
            if (run_dir / directory / name).exists():
                _read_part(run_dir / directory / name)


def _read_parts(directory: Path, names: list[str], schema: Mapping[str, pa.DataType]) -> pd.DataFrame:
    frames = [_read_part(directory / n) for n in names]
    frames = [f for f in frames if len(f)]
    if not frames:
        return _to_table([], schema).to_pandas()
    return pd.concat(frames, ignore_index=True)


def load_run(run_dir: str | Path) -> tuple[dict, dict, pd.DataFrame, pd.DataFrame]:
    """(config, summary, rollouts, steps) of one run folder, committed units only."""
    run_dir = Path(run_dir)
    for name in ("config.yaml", "summary.json", ROLLOUTS_DIR, STEPS_DIR):
        if not (run_dir / name).exists():
            raise RunFolderError(
                f"{run_dir} is not a complete run folder: {name} is missing. Pass a folder "
                f"written by bench.report.results.RunWriter (copy the whole run folder, not parts of it).")
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    summary = json.loads((run_dir / "summary.json").read_text())
    names = sorted(p.name for p in (run_dir / STEPS_DIR).iterdir() if _parse_part(p.name))
    steps = _read_parts(run_dir / STEPS_DIR, names, STEP_SCHEMA)
    present = [n for n in names if (run_dir / ROLLOUTS_DIR / n).exists()]
    rollouts = _read_parts(run_dir / ROLLOUTS_DIR, present, ROLLOUT_SCHEMA)
    if len(present) < len(names):
        print(f"warning: {run_dir}: {len(names) - len(present)} committed unit(s) have no "
              f"rollouts part (folder copied incompletely?)", file=sys.stderr)
    return config, summary, rollouts, steps


def load_iterations(run_dir: str | Path) -> pd.DataFrame:
    """iterations.parquet rows of a run's committed units (empty where the engine logged none)."""
    run_dir = Path(run_dir)
    steps_dir, it_dir = run_dir / STEPS_DIR, run_dir / ITERATIONS_DIR
    if not steps_dir.is_dir() or not it_dir.is_dir():
        return _to_table([], ITERATION_SCHEMA).to_pandas()
    names = sorted(p.name for p in steps_dir.iterdir() if _parse_part(p.name) and (it_dir / p.name).exists())
    return _read_parts(it_dir, names, ITERATION_SCHEMA)
