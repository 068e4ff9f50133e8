"""Writing a trace directory: the manifest, prompts and rollouts files.

The format itself (the layout, :class:`~bench.traces.format.Trace` and its validation) is
``bench.traces.format``; this module holds what the recorder (``bench.traces.record``) and the
importer (``bench.traces.importer``) write with, kept apart from reading; a finished directory is
published by ``bench.core.publish``.

    python -m bench.traces.record --out DIR --tiny     # writes a trace through TraceWriter
    python -m pytest -q tests/test_trace.py            # round trip: TraceWriter, then Trace.load
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from bench.traces.format import FORMAT_VERSION, MANIFEST, PROMPTS, ROLLOUT_COLUMNS, TraceSampling, TraceStep, rollouts_relpath


@dataclass
class TraceWriter:
    """Writes a trace directory incrementally; the manifest is rewritten atomically per step."""

    root: Path
    name: str
    sampling: TraceSampling
    vocab_size: int
    task: str | None = None
    tokenizer: str = "tokenizer"
    extra: dict = field(default_factory=dict)
    steps: list[TraceStep] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def write_prompts(self, records: list[dict]) -> None:
        """records: dicts with prompt_id, token_ids and any task metadata."""
        lines = [json.dumps({"prompt_id": str(r["prompt_id"]), "token_ids": [int(t) for t in r["token_ids"]],
                             **{k: v for k, v in r.items() if k not in ("prompt_id", "token_ids")}})
                 for r in records]
        _atomic_write(self.root / PROMPTS, "\n".join(lines) + "\n")

    def write_rollouts(self, step: int, df) -> str:
        missing = [c for c in ROLLOUT_COLUMNS if c not in df.columns]
        if missing:
            raise ValueError(f"rollouts of step {step} lack columns {missing}")
        rel = rollouts_relpath(step)
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / (rel + ".tmp")
        df.to_parquet(tmp, index=False)
        os.replace(tmp, self.root / rel)
        return rel

    def add_step(self, step: int, checkpoint: str | None, prompt_ids: list[str], rollouts: str | None = None) -> None:
        """``checkpoint`` None: a rollouts-only step (sparse checkpoints; ``rollouts`` required)."""
        if checkpoint is None and rollouts is None:
            raise ValueError(f"step {step} needs a checkpoint or rollouts")
        self.steps.append(TraceStep(step, None if checkpoint is None else str(checkpoint),
                                    [str(p) for p in prompt_ids], rollouts))
        self.write_manifest()

    def write_manifest(self) -> None:
        manifest = {"format_version": FORMAT_VERSION, "name": self.name, "task": self.task,
                    "tokenizer": self.tokenizer, "vocab_size": int(self.vocab_size),
                    "sampling": asdict(self.sampling), **self.extra,
                    "steps": [{k: v for k, v in asdict(s).items() if v is not None} for s in self.steps]}
        _atomic_write(self.root / MANIFEST, yaml.safe_dump(manifest, sort_keys=False, width=120))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
