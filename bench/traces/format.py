"""The trace format: a recorded RL run (checkpoints, prompts per step, optional rollouts), validated.

    python -m bench.traces.format TRACE_DIR        # validate a trace and print its summary

Layout (docs/design.md, "Traces")::

    trace.yaml                 name, tokenizer dir, task, sampling, vocab_size, steps
    prompts.jsonl              {"prompt_id", "token_ids", ...task metadata} per line
    checkpoints/step_00000/    a Hugging Face checkpoint per step (or a symlink to one)
    rollouts/step_00000.parquet  optional: prompt_id, sample_idx, token_ids, logprobs, reward

Every problem found on load raises one :class:`TraceError` naming the file and the fix. Traces are
written with ``bench.traces.writer.TraceWriter``.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from bench.core.errors import UserError

MANIFEST = "trace.yaml"
PROMPTS = "prompts.jsonl"
ROLLOUT_COLUMNS = ("prompt_id", "sample_idx", "token_ids", "logprobs", "reward")
# task name -> module exposing ``score(metadata: dict, text: str) -> float``
TASKS = {"countdown": "bench.traces.record.task", "countdown_search": "bench.traces.record.search_task",
         "word_problems": "bench.traces.record.word_problems"}
FORMAT_VERSION = 1


class TraceError(UserError, ValueError):
    """A trace that cannot be replayed as is; the message names the file and the fix."""


def iter_jsonl(path: Path, error: type[Exception] = None):
    """(line number, object) for every non-blank line of a jsonl file; a bad line raises
    ``error`` (TraceError by default) naming the file and line."""
    error = error or TraceError
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}:{lineno}: not valid JSON ({exc}); fix that line") from exc
        if not isinstance(record, dict):
            raise error(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}; fix that line")
        yield lineno, record


@dataclass
class TraceSampling:
    """The sampling the run used (replays use it unless a config overrides it)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    n: int = 1
    seed: int = 0

    def to_config(self, **overrides):
        """A ``bench.core.sampling.SamplingConfig`` (n is a trace property, not a sampling knob)."""
        from bench.core.sampling import SamplingConfig
        kw = {k: v for k, v in asdict(self).items() if k != "n"}
        kw.update(overrides)
        return SamplingConfig(**kw)


@dataclass
class TraceStep:
    step: int
    checkpoint: str | None  # relative to the trace dir (absolute paths kept); None: rollouts only
    prompt_ids: list[str]
    rollouts: str | None = None  # relative path of the step's rollouts parquet, if recorded


def _trace_step(entry: dict) -> TraceStep:
    """A manifest step entry; a step without ``checkpoint`` is a rollouts-only (sparse) step."""
    return TraceStep(**{"checkpoint": None, **entry})


def rollouts_relpath(step: int) -> str:
    return f"rollouts/step_{step:05d}.parquet"


def checkpoint_relpath(step: int) -> str:
    return f"checkpoints/step_{step:05d}"


def _tokenizer_vocab(directory: Path) -> dict[str, int] | None:
    """token -> id of the tokenizer saved in ``directory`` (None if it holds none)."""
    if (directory / "tokenizer.json").exists():
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab(with_added_tokens=True)
    if (directory / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(directory)).get_vocab()
    return None


def _file_digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def _config_vocab_and_context(ckpt: Path) -> tuple[int, int]:
    cfg = json.loads((ckpt / "config.json").read_text())
    text = cfg.get("text_config") or {}
    vocab = cfg.get("vocab_size", text.get("vocab_size"))
    ctx = cfg.get("max_position_embeddings", text.get("max_position_embeddings"))
    if vocab is None:
        raise TraceError(f"{ckpt}/config.json has no vocab_size: not a language-model config")
    return int(vocab), int(ctx) if ctx else 1 << 30


class Trace:
    """A validated trace directory. Build with :meth:`load`; write with ``bench.traces.writer.TraceWriter``."""

    def __init__(self, root: Path, manifest: dict, prompts: dict[str, list[int]],
                 prompt_meta: dict[str, dict]):
        self.root = Path(root)
        self.manifest = manifest
        self.name: str = manifest["name"]
        self.task: str | None = manifest.get("task")
        self.tokenizer_dir = self._resolve(manifest["tokenizer"])
        self.vocab_size: int = int(manifest["vocab_size"])
        self.sampling = TraceSampling(**manifest["sampling"])
        self.steps = [_trace_step(s) for s in manifest["steps"]]
        self._by_step = {s.step: s for s in self.steps}
        self.prompts = prompts
        self.prompt_meta = prompt_meta
        self._tokenizer = None

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, root: str | Path, validate: bool = True) -> "Trace":
        root = Path(root)
        mpath = root / MANIFEST
        if not mpath.exists():
            raise TraceError(f"{mpath} not found: {root} is not a trace; record one with "
                             f"`python -m bench.traces.record --out {root}` or build one from a run with "
                             f"`python -m bench.traces.importer`")
        try:
            manifest = yaml.safe_load(mpath.read_text()) or {}
        except yaml.YAMLError as exc:
            raise TraceError(f"{mpath} is not valid YAML ({exc}); fix or re-create the manifest") from exc
        missing = [k for k in ("name", "tokenizer", "sampling", "steps", "vocab_size") if k not in manifest]
        if missing:
            raise TraceError(f"{mpath} lacks {missing}; a manifest needs name, tokenizer, vocab_size, "
                             f"sampling and steps (see bench/traces/format.py)")
        try:
            TraceSampling(**manifest["sampling"])
            steps = [_trace_step(s) for s in manifest["steps"]]
        except TypeError as exc:
            raise TraceError(f"{mpath}: bad sampling or steps entry ({exc}); sampling keys are "
                             f"{list(asdict(TraceSampling()))}, step keys step/checkpoint/prompt_ids") from exc
        if len({s.step for s in steps}) != len(steps):
            raise TraceError(f"{mpath} lists a step number twice; give every step a unique number")
        bare = [s.step for s in steps if s.checkpoint is None and s.rollouts is None]
        if bare:
            raise TraceError(f"{mpath}: step(s) {bare[:3]} have neither a checkpoint nor rollouts; give "
                             f"each step a `checkpoint` (replayed) or `rollouts` (fed to the drafters)")
        if steps and all(s.checkpoint is None for s in steps):
            raise TraceError(f"{mpath}: no step has a checkpoint, so there is nothing to replay; add "
                             f"`checkpoint` to a step (simulation needs none: python -m bench.harness.simulate)")
        prompts, meta = cls._read_prompts(root / PROMPTS)
        trace = cls(root, manifest, prompts, meta)
        if validate:
            trace.validate()
        return trace

    @staticmethod
    def _read_prompts(path: Path) -> tuple[dict[str, list[int]], dict[str, dict]]:
        if not path.exists():
            raise TraceError(f"{path} not found: a trace needs its prompts file (one JSON object per "
                             f"line with prompt_id and token_ids); re-record or re-import the trace")
        prompts: dict[str, list[int]] = {}
        meta: dict[str, dict] = {}
        for lineno, rec in iter_jsonl(path):
            try:
                pid, ids = str(rec.pop("prompt_id")), [int(t) for t in rec.pop("token_ids")]
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: not a JSON object with prompt_id and token_ids "
                                 f"({exc}); fix that line") from exc
            if pid in prompts:
                raise TraceError(f"{path}:{lineno}: prompt_id {pid!r} appears twice; ids must be unique")
            prompts[pid], meta[pid] = ids, rec
        return prompts, meta

    def _resolve(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.root / p

    def validate(self) -> None:
        """Raise TraceError for the first problem found (files, vocab, tokenizer, lengths, ids)."""
        mpath = self.root / MANIFEST
        tok_vocab = _tokenizer_vocab(self.tokenizer_dir) if self.tokenizer_dir.is_dir() else None
        if tok_vocab is None:
            raise TraceError(f"tokenizer dir {self.tokenizer_dir} (trace.yaml `tokenizer`) is missing or "
                             f"holds no tokenizer files; point it at a saved Hugging Face tokenizer")
        if len(tok_vocab) > self.vocab_size:
            raise TraceError(f"{self.tokenizer_dir}: the tokenizer has {len(tok_vocab)} tokens but "
                             f"trace.yaml vocab_size is {self.vocab_size}; fix vocab_size in {mpath}")
        tok_digest = _file_digest(self.tokenizer_dir / "tokenizer.json")
        context = 1 << 30
        for s in self.steps:
            if s.checkpoint is None:
                continue  # a rollouts-only step (sparse checkpoints)
            ckpt = self._checkpoint_dir(s.step)
            from bench.traces.deltas import base_of, is_delta
            if is_delta(ckpt):  # checked against its base, merged only when an engine loads it
                ckpt = base_of(ckpt)
            if not (ckpt / "config.json").exists():
                what = "has no config.json" if ckpt.is_dir() else "does not exist"
                raise TraceError(f"checkpoint {ckpt} of step {s.step} {what}; fix its path in {mpath} "
                                 f"or restore the checkpoint (a Hugging Face model dir)")
            vocab, ctx = _config_vocab_and_context(ckpt)
            context = min(context, ctx)
            if vocab != self.vocab_size:
                raise TraceError(f"{ckpt}/config.json vocab_size {vocab} differs from the trace's "
                                 f"{self.vocab_size} ({mpath}): this checkpoint belongs to another model; "
                                 f"drop step {s.step} or fix vocab_size")
            digest = _file_digest(ckpt / "tokenizer.json")
            if digest is not None and digest == tok_digest:
                continue
            ck_vocab = _tokenizer_vocab(ckpt)
            if ck_vocab is not None and ck_vocab != tok_vocab:
                diff = sorted(set(ck_vocab.items()) ^ set(tok_vocab.items()))[:3]
                raise TraceError(f"the tokenizer in {ckpt} differs from the trace tokenizer "
                                 f"{self.tokenizer_dir} (e.g. {diff}); a replay would feed wrong ids: "
                                 f"use checkpoints of one tokenizer or fix `tokenizer` in {mpath}")
        limit = context - self.sampling.max_new_tokens
        for pid, ids in self.prompts.items():
            if len(ids) > limit:
                raise TraceError(f"{self.root / PROMPTS}: prompt {pid!r} has {len(ids)} tokens, more than "
                                 f"the context {context} minus max_new_tokens {self.sampling.max_new_tokens}"
                                 f"; drop the prompt or lower sampling.max_new_tokens in {mpath}")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise TraceError(f"{self.root / PROMPTS}: prompt {pid!r} has token ids {bad[:3]} outside "
                                 f"the vocabulary [0, {self.vocab_size}); re-tokenize it")
        for s in self.steps:
            unknown = [p for p in s.prompt_ids if p not in self.prompts]
            if unknown:
                raise TraceError(f"{mpath}: step {s.step} names prompt ids {unknown[:3]} that are not in "
                                 f"{self.root / PROMPTS}; add them there or remove them from the step")
            if s.rollouts is not None and not self._resolve(s.rollouts).exists():
                raise TraceError(f"{mpath}: step {s.step} rollouts file {self._resolve(s.rollouts)} is "
                                 f"missing; restore it or delete the step's `rollouts` entry")

    # ------------------------------------------------------------------ access
    @property
    def step_numbers(self) -> list[int]:
        """The replayable steps: those with a checkpoint (all of them in a dense trace)."""
        return [s.step for s in self.steps if s.checkpoint is not None]

    @property
    def all_step_numbers(self) -> list[int]:
        """Every step, rollouts-only ones included."""
        return [s.step for s in self.steps]

    @property
    def is_sparse(self) -> bool:
        return any(s.checkpoint is None for s in self.steps)

    def fed_steps(self, after: int | None, before: int) -> list[int]:
        """The rollouts-only steps strictly between ``after`` (None: the start) and ``before``, in
        order: what a sparse replay feeds to the drafters before replaying step ``before``."""
        return [s.step for s in self.steps if s.checkpoint is None and s.step < before
                and (after is None or s.step > after)]

    def step(self, step: int) -> TraceStep:
        if step not in self._by_step:
            raise KeyError(f"trace {self.name!r} has no step {step}; steps are {self.step_numbers}")
        return self._by_step[step]

    def checkpoint(self, step: int) -> Path:
        """The step's Hugging Face checkpoint directory; a delta checkpoint (low-rank deltas on a
        base, ``bench.traces.deltas``) is merged into the cache on first use and that path returned."""
        path = self._checkpoint_dir(step)
        from bench.traces.deltas import is_delta, materialize
        return materialize(path) if is_delta(path) else path

    def _checkpoint_dir(self, step: int) -> Path:
        rel = self.step(step).checkpoint
        if rel is None:
            raise KeyError(f"step {step} of trace {self.name!r} has rollouts only (no checkpoint); "
                           f"replayable steps are {self.step_numbers}")
        return self._resolve(rel)

    def rollouts(self, step: int):
        """The step's recorded rollouts as a pandas DataFrame, or None when none were recorded."""
        s = self.step(step)
        if s.rollouts is None:
            return None
        import pandas as pd
        path = self._resolve(s.rollouts)
        df = pd.read_parquet(path)
        missing = [c for c in ROLLOUT_COLUMNS if c not in df.columns]
        if missing:
            raise TraceError(f"{path} lacks columns {missing}; rollouts need {list(ROLLOUT_COLUMNS)}")
        return df

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        return self._tokenizer

    @property
    def has_reward(self) -> bool:
        return self.task in TASKS

    def reward(self, prompt_id: str, token_ids) -> float:
        """The task reward of a response (token ids after the prompt, EOS included or not)."""
        if not self.has_reward:
            raise TraceError(f"trace {self.name!r} has task {self.task!r}, which has no reward function; "
                             f"known tasks: {sorted(TASKS)} (set `task` in {self.root / MANIFEST})")
        tok = self.tokenizer()
        ids = list(token_ids)
        if tok.eos_token_id in ids:
            ids = ids[:ids.index(tok.eos_token_id)]
        text = tok.decode(ids, skip_special_tokens=False)
        return importlib.import_module(TASKS[self.task]).score(self.prompt_meta[prompt_id], text)

    def __repr__(self) -> str:
        return (f"Trace({self.name!r}, {len(self.steps)} steps, {len(self.prompts)} prompts, "
                f"task={self.task!r}, root={str(self.root)!r})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    args = ap.parse_args()
    try:
        trace = Trace.load(args.trace)
    except TraceError as exc:
        raise SystemExit(f"invalid trace: {exc}")
    print(trace)
    print(f"sampling: {asdict(trace.sampling)}")
    for s in trace.steps:
        print(f"  step {s.step}: {len(s.prompt_ids)} prompts, "
              + (f"checkpoint {s.checkpoint}" if s.checkpoint else "no checkpoint (rollouts fed to drafters)")
              + (f", rollouts {s.rollouts}" if s.rollouts else ""))


if __name__ == "__main__":
    from bench.core.errors import run_main
    run_main(main)
