"""Build a trace from an existing RL run: its saved checkpoints, its prompts, optionally its rollouts.

    python -m bench.traces.importer --checkpoints RUN_DIR --prompts prompts.jsonl --out TRACE_DIR \
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
reward are optional. A rollouts file of a step without a checkpoint makes a rollouts-only step
(a sparse trace: the replay feeds it to the drafters).

Rollout dumps of real runs (``--dump PATH --dump-format verl|trl|samples``, decoded text
re-tokenized with the run's tokenizer; the prompts then come from the dump, ``--prompts`` is not
needed; read by ``bench.traces.rollout_dumps``):

- ``verl``: ``trainer.rollout_data_dir``, one ``{step}.jsonl`` per step, rows ``input``, ``output``
  (decoded with special tokens skipped), ``score``, ``step`` (``gts`` and reward extras kept out);
  the n samples of a prompt are consecutive.
- ``trl``: GRPOTrainer's ``log_completions``: ``completions/completions_{step:05d}.parquet`` under
  the output dir, columns ``step``, ``prompt``, ``completion``, one column per reward function
  (``reward`` if present, else the only one), ``advantage``; logged at logging steps only.
- ``samples``: an evaluation dump, a ``.jsonl`` file (or a directory of them) with one prompt and
  its n samples a line: ``prompt`` (text, or a list of chat messages), ``samples`` (or
  ``completions``, ``responses``, ``outputs``: a list of texts), optional ``rewards``/``scores`` (one
  a sample), ``step`` (default 0) and ``prompt_id``.

Without the run's tokenizer, ``--tokenizer stand-in`` re-tokenizes a dump with SmolLM2-135M-Instruct's
(the real model the suite ships; the ``real`` extra), with a one-line warning that token counts, and
so acceptance and speedups, will differ from the run's. A trace's checkpoints need their own
tokenizer, so ``stand-in`` is for simulation logs (``--log-out``) only.

Multi-turn rollouts with tool calls (verl's agent loop, TRL's conversational completions, samples
that are conversations) keep only what the policy decoded: the tool responses the agent loop
inserted are left out of the generated tokens and counted (``tool_tokens``; a note line says how
many), ``--tool-response-pattern REGEX`` says where they are in decoded text (default: Hermes-style
``<tool_response>`` blocks), and a prompt that is a whole conversation is rendered by the chat
template (``bench.traces.conversations``).

OpenRLHF writes no rollout dump (its trainer logs scalars and, with wandb, sample tables only), so
it has no format here. Without checkpoints, ``python -m bench.traces.importer --dump DIR
--dump-format verl --tokenizer TOK --log-out LOG_DIR`` writes a simulation log
(``step_<N>.parquet``) for ``python -m bench.harness.simulate LOG_DIR``. Re-tokenized ids may differ from
the generated ones (special tokens were stripped, and text does not always round-trip): the
rollouts carry ``retokenized: true`` and the trace or log says so.
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

from bench.traces.format import Trace, TraceError, TraceSampling, checkpoint_relpath, iter_jsonl
from bench.traces.conversations import TOOL_RESPONSE_PATTERN
from bench.traces.rollout_dumps import (DUMP_FORMATS, RETOKENIZED_NOTE, STAND_IN, dump_prompts, load_tokenizer, read_dump,
                                       tool_note, write_dump_log)
from bench.core.publish import publish_dir
from bench.traces.writer import TraceWriter

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
        if not nums:
            raise TraceError(f"rollouts file {f}: the last number in its name must be its step (a checkpoint "
                             f"step, one of {sorted(steps)}, or a rollouts-only step)")
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


def _tokenizer_dir(ckpts: list[tuple[int, Path]], checkpoints: Path, tokenizer_dir: Path | None) -> tuple[Path, str]:
    """The tokenizer to read the prompts with, and how the manifest names it: ``--tokenizer``'s dir
    (absolute), else the first checkpoint that holds tokenizer files (relative to the trace)."""
    if tokenizer_dir:
        return Path(tokenizer_dir), str(Path(tokenizer_dir).resolve())
    tok_step = next((s for s, d in ckpts
                     if (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists()), None)
    if tok_step is None:
        raise TraceError(f"no checkpoint under {checkpoints} holds tokenizer files; pass --tokenizer DIR")
    return dict(ckpts)[tok_step], checkpoint_relpath(tok_step)


def _records_and_rollouts(prompts: Path | None, rollouts: Path | None, dump: Path | None, dump_format: str | None,
                          tokenizer, add_special_tokens: bool, ckpt_steps: list[int],
                          tool_pattern: str | None = TOOL_RESPONSE_PATTERN) -> tuple[list[dict], dict]:
    """The prompt records and step -> rollouts: from ``--dump`` (its prompts unless ``--prompts``
    is given too), or from ``--prompts`` and the optional ``--rollouts``."""
    if dump is not None:
        if rollouts is not None:
            raise TraceError("pass --rollouts or --dump, not both")
        step_rollouts = read_dump(Path(dump), dump_format or "verl", tokenizer, add_special_tokens, tool_pattern)
        note = tool_note(step_rollouts)
        if note:
            print(note)
        records = dump_prompts(step_rollouts) if prompts is None else \
            read_prompts(Path(prompts), tokenizer, add_special_tokens)
    elif prompts is None:
        raise TraceError("pass --prompts (or --dump with a rollout dump, whose prompts are used)")
    else:
        records = read_prompts(Path(prompts), tokenizer, add_special_tokens)
    with_step = [r for r in records if r["steps"] is not None]
    if with_step and len(with_step) != len(records):
        raise TraceError(f"{prompts}: {len(with_step)} of {len(records)} prompts carry `step`; give it to "
                         f"all prompts or to none")
    if dump is None:
        step_rollouts = read_rollouts(Path(rollouts), tokenizer, set(ckpt_steps)) if rollouts else {}
    return records, step_rollouts


def _prompts_per_step(records: list[dict], step_rollouts: dict, steps: list[int], steps_per_prompt_visit: int,
                      prompts: Path | None, checkpoints: Path) -> dict[int, list[str]]:
    """step -> its prompt ids: the prompts' own ``step``; without, the prompts of the step's
    rollouts, else the step's turn of ``steps_per_prompt_visit`` chunks."""
    if not 1 <= steps_per_prompt_visit <= len(records):
        raise TraceError(f"--steps-per-prompt-visit must be in [1, {len(records)}] (number of prompts)")
    per_step: dict[int, list[str]] = {s: [] for s in steps}
    if any(r["steps"] is not None for r in records):  # then all of them carry it
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
    return per_step


def _trace_sampling(sampling: dict | None, step_rollouts: dict) -> dict:
    """The given sampling with ``max_new_tokens`` and ``n`` inferred from the rollouts where unset."""
    sampling = dict(sampling or {})
    if sampling.get("max_new_tokens") is None:
        if not step_rollouts:
            raise TraceError("pass --max-new-tokens (the run's response length limit); it can only be "
                             "inferred from --rollouts")
        sampling["max_new_tokens"] = max(int(df["token_ids"].map(len).max()) for df in step_rollouts.values())
    if sampling.get("n") is None:
        sampling["n"] = max((int(df.groupby("prompt_id").size().max()) for df in step_rollouts.values()),
                            default=1)
    return {k: v for k, v in sampling.items() if v is not None}


def _write_steps(writer: TraceWriter, steps: list[int], ckpt_dirs: dict[int, Path], records: list[dict],
                 step_rollouts: dict, per_step: dict[int, list[str]], prompts: Path | None) -> None:
    """Every step into the trace being written: its checkpoint symlinked, its rollouts copied."""
    known = {r["prompt_id"] for r in records}
    for s in steps:
        rel = None
        if s in ckpt_dirs:
            rel = checkpoint_relpath(s)
            (writer.root / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(ckpt_dirs[s].resolve(), writer.root / rel, target_is_directory=True)
        roll = None
        if s in step_rollouts:
            df = step_rollouts[s].drop(columns=["prompt_text"], errors="ignore")
            unknown = sorted(set(df["prompt_id"]) - known)[:3]
            if unknown:
                raise TraceError(f"rollouts of step {s} name prompt ids {unknown} not in {prompts}")
            roll = writer.write_rollouts(s, df)
        writer.add_step(s, rel, per_step[s], roll)


def import_trace(checkpoints: Path, prompts: Path | None, out: Path, rollouts: Path | None = None,
                 steps_per_prompt_visit: int = 1, name: str | None = None, task: str | None = None,
                 sampling: dict | None = None, tokenizer_dir: Path | None = None,
                 add_special_tokens: bool = True, dump: Path | None = None,
                 dump_format: str | None = None, tool_pattern: str | None = TOOL_RESPONSE_PATTERN) -> Trace:
    """Build and validate a trace in ``out`` (written to a temp dir, renamed when valid)."""
    from transformers import AutoTokenizer

    out = Path(out)
    if out.exists():
        raise TraceError(f"--out {out} already exists; choose a new directory")
    ckpts = find_checkpoints(Path(checkpoints))
    tok_dir, tok_ref = _tokenizer_dir(ckpts, checkpoints, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    records, step_rollouts = _records_and_rollouts(prompts, rollouts, dump, dump_format, tokenizer,
                                                   add_special_tokens, [s for s, _ in ckpts], tool_pattern)
    steps = sorted({s for s, _ in ckpts} | set(step_rollouts))  # a rollouts file without a checkpoint: rollouts only
    per_step = _prompts_per_step(records, step_rollouts, steps, steps_per_prompt_visit, prompts, checkpoints)
    sampling = _trace_sampling(sampling, step_rollouts)
    vocab = json.loads((ckpts[0][1] / "config.json").read_text())
    vocab = vocab.get("vocab_size") or (vocab.get("text_config") or {}).get("vocab_size")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
    try:
        extra = {"imported_from": str(Path(checkpoints).resolve())}
        if dump is not None:
            extra.update(rollouts_retokenized=True, rollouts_note=f"{dump_format or 'verl'} dump: {RETOKENIZED_NOTE}")
        writer = TraceWriter(tmp, name or out.name, TraceSampling(**sampling), vocab_size=int(vocab),
                             task=task, tokenizer=tok_ref, extra=extra)
        writer.write_prompts([{"prompt_id": r["prompt_id"], "token_ids": r["token_ids"], **r["meta"]}
                              for r in records])
        _write_steps(writer, steps, dict(ckpts), records, step_rollouts, per_step, prompts)
        Trace.load(tmp)  # validate before publishing
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Trace.load(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=Path, help="run dir holding numbered checkpoints (a trace)")
    ap.add_argument("--prompts", type=Path, help="prompts .jsonl (text or token_ids); not needed with --dump")
    ap.add_argument("--out", type=Path, help="trace dir to create")
    ap.add_argument("--rollouts", type=Path, help="dir of per-step rollout files (.jsonl/.parquet)")
    ap.add_argument("--dump", type=Path, help="a real run's rollout dump dir, or an evaluation dump .jsonl "
                                              "(see --dump-format)")
    ap.add_argument("--dump-format", choices=DUMP_FORMATS, default="verl",
                    help="verl: trainer.rollout_data_dir {step}.jsonl; trl: GRPOTrainer log_completions parquet; "
                         "samples: jsonl lines of a prompt and its samples")
    ap.add_argument("--tool-response-pattern", default=TOOL_RESPONSE_PATTERN, metavar="REGEX",
                    help="in decoded multi-turn outputs, the tool responses the agent loop inserted (left out of the "
                         "generated tokens); default: Hermes-style <tool_response> blocks; none: keep the whole output")
    ap.add_argument("--log-out", type=Path, help="with --dump and no --checkpoints: write a simulation log here")
    ap.add_argument("--steps-per-prompt-visit", type=int, default=1,
                    help="steps between two visits of a prompt when prompts carry no `step`")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: the first checkpoint's); 'stand-in': "
                    "SmolLM2-135M-Instruct's, for a dump whose run's tokenizer is not at hand (counts will differ)")
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
    if a.checkpoints is None:
        if a.dump is None or a.log_out is None:
            raise TraceError("pass --checkpoints RUN_DIR --out TRACE_DIR (a trace), or --dump DIR --tokenizer TOK "
                             "--log-out LOG_DIR (a simulation log of a rollout dump)")
        steps = read_dump(a.dump, a.dump_format, load_tokenizer(a.tokenizer), not a.no_special_tokens,
                          a.tool_response_pattern)
        note = tool_note(steps)
        if note:
            print(note)
        out = write_dump_log(steps, a.log_out)
        print(f"wrote {sum(len(df) for df in steps.values())} rollouts of {len(steps)} steps to {out} "
              f"(python -m bench.harness.simulate {out}); note: {RETOKENIZED_NOTE}")
        return
    if a.out is None:
        raise TraceError("pass --out TRACE_DIR (the trace to create)")
    if a.tokenizer is not None and str(a.tokenizer) == STAND_IN and not a.tokenizer.exists():
        raise TraceError("--tokenizer stand-in is for a dump without checkpoints (--dump ... --log-out LOG_DIR): a "
                         "trace's checkpoints need the run's own tokenizer (--tokenizer DIR)")
    if a.tokenizer is not None:
        load_tokenizer(a.tokenizer)
    sampling = {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
                "max_new_tokens": a.max_new_tokens, "n": a.n, "seed": a.seed}
    trace = import_trace(a.checkpoints, a.prompts, a.out, a.rollouts, a.steps_per_prompt_visit, a.name,
                         a.task, sampling, a.tokenizer, not a.no_special_tokens, dump=a.dump,
                         dump_format=a.dump_format if a.dump else None, tool_pattern=a.tool_response_pattern)
    print(f"wrote {trace} ({sum(len(s.prompt_ids) for s in trace.steps)} step-prompts, "
          f"{sum(s.rollouts is not None for s in trace.steps)} steps with rollouts, "
          f"{sum(s.checkpoint is None for s in trace.steps)} of them without a checkpoint) to {a.out}"
          + (f"; note: {RETOKENIZED_NOTE}" if a.dump else ""))


if __name__ == "__main__":
    from bench.core.errors import run_main
    run_main(main)
