"""A closed-loop run's folder, written so a killed run loses at most the step in flight.

    <run>/config.json              the run's identity (a rerun with another config is refused)
    <run>/state/step_XXXXX.pt      policy, optimizer and drafter after step XXXXX (the latest only)
    <run>/eval/step_XXXXX.npy      held-out log-probs of the policy that generated step XXXXX
    <run>/steps/step_XXXXX.parquet one row of step XXXXX: the commit marker, written last

Every file is written to a hidden temp name, fsync'd and renamed into place, in the order above, so a step
whose row exists has its state and its held-out array; a state or array without a row is the
step in flight and is simply redone on resume.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from bench.core.errors import UserError
from bench.report.results import _TMP_PREFIX, _atomic_write_bytes

CONFIG = "config.json"


def _atomic(path: Path, write) -> None:
    """``write(file)`` into a hidden temp file, fsync'd, renamed onto ``path`` (bench.report.results')."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_bytes(path, write)


def _step_of(path: Path) -> int | None:
    stem = path.name.split(".")[0]
    if path.name.startswith((".", _TMP_PREFIX)) or not stem.startswith("step_"):
        return None
    try:
        return int(stem[5:])
    except ValueError:
        return None


class TrainRunFolder:
    """Read and write one closed-loop run (see the module docstring for the layout)."""

    def __init__(self, run_dir: Path, identity: dict | None = None):
        self.run_dir = Path(run_dir)
        if identity is not None:
            self._check_identity(identity)

    def _check_identity(self, identity: dict) -> None:
        path = self.run_dir / CONFIG
        text = json.dumps(identity, sort_keys=True, default=str)
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise UserError(f"{path} is not valid JSON ({exc}); delete the folder {self.run_dir} "
                                f"to start this run again") from exc
            new = json.loads(text)
            if old != new:
                keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                raise UserError(f"{self.run_dir} holds a closed-loop run with another config (differs in "
                                f"{', '.join(keys)}); give this run another run_id or delete that folder")
            return
        _atomic(path, lambda f: f.write(text.encode()))

    @property
    def identity(self) -> dict:
        return json.loads((self.run_dir / CONFIG).read_text())

    def done_steps(self) -> list[int]:
        """Committed steps; they must be 0..k (a gap means a foreign or damaged folder)."""
        folder = self.run_dir / "steps"
        steps = sorted(s for s in map(_step_of, folder.glob("step_*.parquet")) if s is not None) \
            if folder.exists() else []
        if steps != list(range(len(steps))):
            raise UserError(f"{folder} holds steps {steps}, not 0..{len(steps) - 1}: the run cannot "
                            f"resume exactly; delete {self.run_dir} to start it again")
        return steps

    def state_path(self, step: int) -> Path:
        return self.run_dir / "state" / f"step_{step:05d}.pt"

    def load_state(self, step: int) -> bytes:
        """The committed state of ``step`` (policy, optimizer, drafter), for a resume."""
        path = self.state_path(step)
        if not path.exists():
            raise UserError(f"{path} is missing, so {self.run_dir} cannot resume after step {step}; delete "
                            f"{self.run_dir} to start the run again")
        return path.read_bytes()

    def eval_path(self, step: int) -> Path:
        return self.run_dir / "eval" / f"step_{step:05d}.npy"

    def commit(self, step: int, row: dict, heldout_logp: np.ndarray, save_state) -> None:
        """Write step ``step``: its state (``save_state(file)``), its held-out array, then its row;
        older states are removed after the row lands."""
        _atomic(self.state_path(step), save_state)
        _atomic(self.eval_path(step), lambda f: np.save(f, heldout_logp))
        _atomic(self.run_dir / "steps" / f"step_{step:05d}.parquet",
                lambda f: pd.DataFrame([row]).to_parquet(f, index=False))
        for path in (self.run_dir / "state").glob("step_*.pt"):
            if _step_of(path) is not None and _step_of(path) != step:
                path.unlink(missing_ok=True)

    def rows(self) -> pd.DataFrame:
        folder = self.run_dir / "steps"
        parts = sorted(folder.glob("step_*.parquet")) if folder.exists() else []
        parts = [p for p in parts if _step_of(p) is not None]
        if not parts:
            return pd.DataFrame()
        frames = []
        for p in parts:
            try:
                frames.append(pd.read_parquet(p))
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds
                raise UserError(f"{p} cannot be read ({type(exc).__name__}); delete it and rerun the "
                                f"same command to redo that step") from exc
        return pd.concat(frames, ignore_index=True)

    def heldout(self, step: int) -> np.ndarray | None:
        path = self.eval_path(step)
        return np.load(path) if path.exists() else None
