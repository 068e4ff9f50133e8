"""Build a trace from an existing RL run: its saved checkpoints, its prompts, optionally its rollouts.

    python -m bench.trace_import --checkpoints RUN_DIR --prompts prompts.jsonl --out TRACE_DIR \
        [--rollouts ROLLOUT_DIR] [--steps-per-prompt-visit 4] [--max-new-tokens 1024]

Checkpoints are Hugging Face dirs (config.json + *.safetensors) anywhere under RUN_DIR, numbered
by a path component ``global_step_N`` (verl: ``global_step_N/actor/huggingface``), ``checkpoint-N``
(TRL / transformers Trainer) or ``step_N``; they are symlinked, never copied. The prompts file is
JSON lines with ``text`` (tokenized with the checkpoints' tokenizer) or ``token_ids``, an optional
``prompt_id`` and an optional ``step`` (int or list: the checkpoint steps that used the prompt);
other keys are kept as task metadata. Without ``step``, the prompts of a step are those of its
rollouts file if one is given, else the prompts are cut into ``--steps-per-prompt-visit`` chunks
visited in turn (1: every step uses every prompt). Rollout files (``*.jsonl``/``*.parquet``, the
last number in the name is the step) need prompt_id and token_ids; sample_idx, logprobs and
reward are optional.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

from .trace import Trace, TraceError, TraceSampling, TraceWriter, checkpoint_relpath, iter_jsonl, publish_dir

STEP_PATTERNS = [re.compile(p) for p in (r"^global_step_(\d+)$", r"^checkpoint-(\d+)$", r"^step_?(\d+)$")]


def _step_of(parts: tuple[str, ...]) -> int | None:
    for part in reversed(parts):
        for pat in STEP_PATTERNS:
            m = pat.match(part)
            if m:
                return int(m.group(1))
    return None


def find_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every numbered checkpoint under ``root``, sorted by step."""
    root = Path(root)
    if not root.is_dir():
        raise TraceError(f"--checkpoints {root} is not a directory")
    found: dict[int, list[Path]] = {}
    for cfg in sorted(root.rglob("config.json")):
        d = cfg.parent
        step = _step_of(d.relative_to(root).parts)
        if step is not None:
            found.setdefault(step, []).append(d)
    if not found:
        raise TraceError(f"no checkpoint dirs under {root}: expected dirs with config.json under a path "
                         f"component global_step_N, checkpoint-N or step_N")
    out = []
    for step, dirs in sorted(found.items()):
        if len(dirs) > 1:  # verl saves actor and critic side by side: the policy is the actor
            actors = [d for d in dirs if "actor" in d.parts]
            if len(actors) != 1:
                raise TraceError(f"step {step} has several checkpoint dirs {[str(d) for d in dirs]}; "
                                 f"keep one policy checkpoint per step")
            dirs = actors
        d = dirs[0]
        if not any(d.glob("*.safetensors")):
            raise TraceError(f"checkpoint {d} (step {step}) has config.json but no *.safetensors weights; "
                             f"convert or merge them into a Hugging Face dir first (verl: its model "
                             f"merger; .bin files: load and save_pretrained)")
        out.append((step, d))
    return out


def _read_table(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pandas as pd
        return pd.read_parquet(path).to_dict("records")
    return [record for _, record in iter_jsonl(path)]


def read_prompts(path: Path, tokenizer, add_special_tokens: bool = True) -> list[dict]:
    """Prompt records with prompt_id, token_ids, steps (list or None) and metadata."""
    if not Path(path).exists():
        raise TraceError(f"--prompts {path} not found")
    records, seen = [], set()
    for i, rec in enumerate(_read_table(Path(path))):
        pid = str(rec.pop("prompt_id", f"p{i:05d}"))
        if pid in seen:
            raise TraceError(f"{path}: prompt_id {pid!r} appears twice; ids must be unique")
        seen.add(pid)
        if rec.get("token_ids") is not None:
            ids = [int(t) for t in rec.pop("token_ids")]
        elif isinstance(rec.get("text"), str):
            ids = tokenizer(rec["text"], add_special_tokens=add_special_tokens)["input_ids"]
        else:
            raise TraceError(f"{path}: record {i} (prompt {pid!r}) has neither `text` nor `token_ids`")
        step = rec.pop("step", None)
        steps = None if step is None else [int(s) for s in (step if isinstance(step, list) else [step])]
        records.append({"prompt_id": pid, "token_ids": ids, "steps": steps, "meta": rec})
    if not records:
        raise TraceError(f"{path} holds no prompts")
    return records


def read_rollouts(directory: Path, tokenizer, steps: set[int]) -> dict[int, "object"]:
    """step -> DataFrame with the trace's rollout columns."""
    import pandas as pd
    files = sorted(p for p in Path(directory).iterdir() if p.suffix in (".jsonl", ".parquet"))
    if not files:
        raise TraceError(f"--rollouts {directory} holds no *.jsonl or *.parquet files")
    out = {}
    for f in files:
        nums = re.findall(r"\d+", f.stem)
        if not nums or int(nums[-1]) not in steps:
            raise TraceError(f"rollouts file {f}: the last number in its name must be a checkpoint step "
                             f"(one of {sorted(steps)})")
        df = pd.DataFrame(_read_table(f))
        if "prompt_id" not in df.columns or "token_ids" not in df.columns:
            raise TraceError(f"{f} needs columns prompt_id and token_ids (has {list(df.columns)})")
        df["prompt_id"] = df["prompt_id"].astype(str)
        df["token_ids"] = df["token_ids"].map(lambda t: [int(x) for x in t])
        if "sample_idx" not in df.columns:
            df["sample_idx"] = df.groupby("prompt_id", sort=False).cumcount()
        if "logprobs" not in df.columns:
            df["logprobs"] = None
        if "reward" not in df.columns:
            df["reward"] = math.nan
        out[int(nums[-1])] = df
    return out


def import_trace(checkpoints: Path, prompts: Path, out: Path, rollouts: Path | None = None,
                 steps_per_prompt_visit: int = 1, name: str | None = None, task: str | None = None,
                 sampling: dict | None = None, tokenizer_dir: Path | None = None,
                 add_special_tokens: bool = True) -> Trace:
    """Build and validate a trace in ``out`` (written to a temp dir, renamed when valid)."""
    from transformers import AutoTokenizer

    out = Path(out)
    if out.exists():
        raise TraceError(f"--out {out} already exists; choose a new directory")
    ckpts = find_checkpoints(Path(checkpoints))
    steps = [s for s, _ in ckpts]
    if tokenizer_dir:
        tok_dir, tok_ref = Path(tokenizer_dir), str(Path(tokenizer_dir).resolve())
    else:
        tok_step = next((s for s, d in ckpts
                         if (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists()), None)
        if tok_step is None:
            raise TraceError(f"no checkpoint under {checkpoints} holds tokenizer files; pass --tokenizer DIR")
        tok_dir, tok_ref = dict(ckpts)[tok_step], checkpoint_relpath(tok_step)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    records = read_prompts(Path(prompts), tokenizer, add_special_tokens)
    with_step = [r for r in records if r["steps"] is not None]
    if with_step and len(with_step) != len(records):
        raise TraceError(f"{prompts}: {len(with_step)} of {len(records)} prompts carry `step`; give it to "
                         f"all prompts or to none")
    step_rollouts = read_rollouts(Path(rollouts), tokenizer, set(steps)) if rollouts else {}
    if not 1 <= steps_per_prompt_visit <= len(records):
        raise TraceError(f"--steps-per-prompt-visit must be in [1, {len(records)}] (number of prompts)")
    per_step: dict[int, list[str]] = {s: [] for s in steps}
    if with_step:
        for r in records:
            for s in r["steps"]:
                if s not in per_step:
                    raise TraceError(f"{prompts}: prompt {r['prompt_id']!r} has step {s}, which has no "
                                     f"checkpoint under {checkpoints} (steps: {steps})")
                per_step[s].append(r["prompt_id"])
    else:
        chunk = math.ceil(len(records) / steps_per_prompt_visit)
        for k, s in enumerate(steps):
            if s in step_rollouts:
                per_step[s] = list(dict.fromkeys(step_rollouts[s]["prompt_id"]))
            else:
                part = k % steps_per_prompt_visit
                per_step[s] = [r["prompt_id"] for r in records[part * chunk:(part + 1) * chunk]]
    sampling = dict(sampling or {})
    if sampling.get("max_new_tokens") is None:
        if not step_rollouts:
            raise TraceError("pass --max-new-tokens (the run's response length limit); it can only be "
                             "inferred from --rollouts")
        sampling["max_new_tokens"] = max(int(df["token_ids"].map(len).max()) for df in step_rollouts.values())
    if sampling.get("n") is None:
        sampling["n"] = max((int(df.groupby("prompt_id").size().max()) for df in step_rollouts.values()),
                            default=1)
    sampling = {k: v for k, v in sampling.items() if v is not None}
    vocab = json.loads((ckpts[0][1] / "config.json").read_text())
    vocab = vocab.get("vocab_size") or (vocab.get("text_config") or {}).get("vocab_size")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
    try:
        writer = TraceWriter(tmp, name or out.name, TraceSampling(**sampling), vocab_size=int(vocab),
                             task=task, tokenizer=tok_ref,
                             extra={"imported_from": str(Path(checkpoints).resolve())})
        writer.write_prompts([{"prompt_id": r["prompt_id"], "token_ids": r["token_ids"], **r["meta"]}
                              for r in records])
        known = {r["prompt_id"] for r in records}
        for s, d in ckpts:
            rel = checkpoint_relpath(s)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(d.resolve(), tmp / rel, target_is_directory=True)
            roll = None
            if s in step_rollouts:
                df = step_rollouts[s]
                unknown = sorted(set(df["prompt_id"]) - known)[:3]
                if unknown:
                    raise TraceError(f"rollouts of step {s} name prompt ids {unknown} not in {prompts}")
                roll = writer.write_rollouts(s, df)
            writer.add_step(s, rel, per_step[s], roll)
        Trace.load(tmp)  # validate before publishing
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Trace.load(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=Path, required=True, help="run dir holding numbered checkpoints")
    ap.add_argument("--prompts", type=Path, required=True, help="prompts .jsonl (text or token_ids)")
    ap.add_argument("--out", type=Path, required=True, help="trace dir to create")
    ap.add_argument("--rollouts", type=Path, help="dir of per-step rollout files (.jsonl/.parquet)")
    ap.add_argument("--steps-per-prompt-visit", type=int, default=1,
                    help="steps between two visits of a prompt when prompts carry no `step`")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: the first checkpoint's)")
    ap.add_argument("--no-special-tokens", action="store_true", help="tokenize text without BOS etc.")
    ap.add_argument("--name")
    ap.add_argument("--task", help="task name for rewards (e.g. countdown); none by default")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, help="default: longest recorded rollout")
    ap.add_argument("--n", type=int, help="samples per prompt (default: from rollouts, else 1)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    sampling = {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
                "max_new_tokens": a.max_new_tokens, "n": a.n, "seed": a.seed}
    try:
        trace = import_trace(a.checkpoints, a.prompts, a.out, a.rollouts, a.steps_per_prompt_visit, a.name,
                             a.task, sampling, a.tokenizer, not a.no_special_tokens)
    except TraceError as exc:
        raise SystemExit(f"import failed: {exc}")
    print(f"wrote {trace} ({sum(len(s.prompt_ids) for s in trace.steps)} step-prompts, "
          f"{sum(s.rollouts is not None for s in trace.steps)} steps with rollouts) to {a.out}")


if __name__ == "__main__":
    main()
