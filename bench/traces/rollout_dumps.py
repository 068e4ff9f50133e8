"""Rollout dumps of real RL runs (verl, TRL) and evaluation dumps (a prompt and its n samples)
read as per-step rollouts, re-tokenized from their text.

``bench.traces.importer`` builds a trace from checkpoints; this module reads the rollout dumps
its ``--dump PATH --dump-format verl|trl|samples`` flags name (the formats are described in the
importer's docstring), and writes a dump without checkpoints as a simulation log. Kept apart
because it reads other tools' files, not this suite's layout. Without the run's tokenizer,
``--tokenizer stand-in`` re-tokenizes with SmolLM2-135M-Instruct's (the real model the suite
ships), with a one-line warning that token counts will differ.

    python -m bench.traces.importer --dump DIR --dump-format verl --tokenizer TOK --log-out LOG_DIR
    python -m bench.traces.importer --dump evals.jsonl --dump-format samples --tokenizer stand-in --log-out LOG_DIR
    python -m pytest -q tests/test_trace_import.py     # on fixtures in exactly those formats
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from bench.traces.conversations import (TOOL_RESPONSE_PATTERN, Generated, is_messages, render_prompt, split_decoded,
                                        split_messages, tool_regex)
from bench.traces.format import TraceError, iter_jsonl

DUMP_FORMATS = ("verl", "trl", "samples")
SAMPLES_KEYS = ("samples", "completions", "responses", "outputs")  # an evaluation dump's list of samples
REWARDS_KEYS = ("rewards", "scores")
STAND_IN = "stand-in"
STAND_IN_WARNING = ("warning: --tokenizer stand-in: text re-tokenized with SmolLM2-135M-Instruct's tokenizer "
                    "(vocabulary 49,152), not the run's: token counts, acceptance and speedups will differ from "
                    "the run's")
VERL_FIELDS = ("input", "output", "step")
TRL_FIELDS = ("step", "prompt", "completion")
TRL_NOT_REWARDS = {"step", "prompt", "completion", "advantage", "mode", "image", "images"}
RETOKENIZED_NOTE = ("token ids re-tokenized from decoded text (special tokens were stripped), so they may "
                    "differ from the ids the run generated")


def load_tokenizer(path: Path | str | None, what: str = "--tokenizer"):
    """A Hugging Face tokenizer from a local dir (``stand-in``: SmolLM2-135M-Instruct's, with a
    warning on stderr); a missing or unreadable one is a TraceError."""
    if path is not None and str(path) == STAND_IN and not Path(path).exists():
        return _stand_in_tokenizer(what)
    if path is None:
        raise TraceError(f"re-tokenizing a rollout dump needs the run's tokenizer: pass {what} DIR "
                         f"(a saved Hugging Face tokenizer)")
    p = Path(path)
    if not p.is_dir() or not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise TraceError(f"{what} {p}: unknown tokenizer (no tokenizer.json or tokenizer_config.json there); "
                         f"pass the run's saved tokenizer dir")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as exc:  # a corrupt file: say which dir
        raise TraceError(f"{what} {p}: the tokenizer cannot be loaded ({exc}); pass the run's saved tokenizer dir") from exc


def _stand_in_tokenizer(what: str):
    import sys

    from transformers import AutoTokenizer

    from bench.traces.real_model import RealModelError, ensure_real_model
    try:
        folder = ensure_real_model()
    except RealModelError as exc:
        raise TraceError(f"{what} {STAND_IN} needs the real model: {exc}") from exc
    print(STAND_IN_WARNING, file=sys.stderr)
    return AutoTokenizer.from_pretrained(str(folder))


def _dump_files(directory: Path, fmt: str) -> dict[int, Path]:
    d = Path(directory)
    if fmt not in DUMP_FORMATS:
        raise TraceError(f"--dump-format {fmt!r}: known formats are {list(DUMP_FORMATS)} (OpenRLHF writes no "
                         f"rollout dump)")
    if not d.is_dir():
        raise TraceError(f"--dump {d} is not a directory")
    if fmt == "verl":
        pattern, glob = re.compile(r"^(\d+)\.jsonl$"), "*.jsonl"
    else:
        pattern, glob = re.compile(r"^completions_(\d+)\.parquet$"), "completions_*.parquet"
        for sub in (d / "completions" / "train", d / "completions"):  # the trainer's output dir given
            if sub.is_dir() and any(sub.glob(glob)):
                d = sub
                break
    files = {}
    for f in sorted(d.glob(glob)):
        m = pattern.match(f.name)
        if m:
            files[int(m.group(1))] = f
    if not files:
        want = "{step}.jsonl files (trainer.rollout_data_dir)" if fmt == "verl" else \
            "completions/completions_{step:05d}.parquet files (log_completions=True)"
        raise TraceError(f"--dump {directory} holds no {fmt} rollout dump: expected {want}")
    return files


def _text(value, path: Path, where: str, tokenizer, prompt: bool, tools=None) -> list[int] | str | Generated:
    """A prompt as text or token ids (a conversation, by the chat template); an output as the text
    the policy decoded, tool responses left out (``bench.traces.conversations``)."""
    if isinstance(value, str):
        return value if prompt else split_decoded(value, tools)
    if is_messages(value):
        return render_prompt(value, tokenizer, f"{path}{where}") if prompt else split_messages(value, f"{path}{where}")
    raise TraceError(f"{path}{where}: expected text or a list of chat messages, got {type(value).__name__}")


def _output_row(generated: Generated, tokenizer) -> dict:
    """The columns of one rollout's output: its generated token ids and the tool tokens left out."""
    return {"token_ids": tokenizer(generated.text, add_special_tokens=False)["input_ids"],
            "tool_tokens": len(tokenizer(generated.tool_text, add_special_tokens=False)["input_ids"])
            if generated.tool_text else 0}


def tool_note(steps: dict[int, "object"]) -> str | None:
    """One line on what was left out of multi-turn rollouts, or None where nothing was."""
    frames = [df for df in steps.values() if "tool_tokens" in df]
    tool = sum(int(df["tool_tokens"].sum()) for df in frames)
    if not tool:
        return None
    rows = sum(int((df["tool_tokens"] > 0).sum()) for df in frames)
    total = sum(len(df) for df in steps.values())
    gen = sum(len(t) for df in steps.values() for t in df["token_ids"])
    return (f"note: {rows} of {total} rollouts are multi-turn: {tool:,} tool-response tokens "
            f"({tool / (tool + gen):.1%} of their output) are left out of the generated tokens, since the agent "
            f"loop inserts them; the simulation decodes each rollout's policy turns back to back "
            f"(--tool-response-pattern none keeps them)")


def _dump_records(f: Path, fmt: str, step: int):
    """The rows of one dump file, checked (present, every needed field, all of ``step``), and
    ``where(i)``: how a message names row i (its line of a jsonl file, its row of a parquet one)."""
    if fmt == "verl":
        rows = list(iter_jsonl(f))
        need, where = VERL_FIELDS, lambda i: f":{rows[i][0]}"
        records = [r for _, r in rows]
    else:
        import pandas as pd
        try:
            frame = pd.read_parquet(f)
        except Exception as exc:
            raise TraceError(f"{f}: not a readable parquet file ({exc})") from exc
        need, where = TRL_FIELDS, lambda i: f" row {i}"
        records = frame.to_dict("records")
    if not records:
        raise TraceError(f"{f} holds no rollouts")
    for i, r in enumerate(records):
        missing = [k for k in need if k not in r or r[k] is None]
        if missing:
            raise TraceError(f"{f}{where(i)}: missing field(s) {missing}; a {fmt} rollout dump row needs "
                             f"{list(need)}")
    steps = sorted({int(r["step"]) for r in records})
    if steps != [step]:
        raise TraceError(f"{f}: rows of step(s) {steps[:4]} in the file of step {step}; a dump file holds one "
                         f"step (split it, or fix the `step` field)")
    return records, where


def _dump_rewards(records: list[dict], fmt: str) -> list[float]:
    """verl's ``score``; TRL's ``reward`` column, else its only reward column (NaN without one)."""
    if fmt == "verl":
        return [float(r["score"]) if r.get("score") is not None else math.nan for r in records]
    cols = [c for c in records[0] if c not in TRL_NOT_REWARDS]
    col = "reward" if "reward" in cols else (cols[0] if len(cols) == 1 else None)
    return [float(r[col]) if col is not None and r[col] is not None else math.nan for r in records]


def _sample_files(path: Path) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else []
    if not files:
        raise TraceError(f"--dump {p}: an evaluation dump is a .jsonl file (or a directory of them) with one "
                         f"prompt and its samples a line")
    return files


def _sample_records(path: Path):
    """(file, line, prompt, samples, rewards, step, prompt_id) for every line of an evaluation dump:
    ``{"prompt": text or chat messages, "samples": [text, ...]}`` (or ``completions``, ``responses``,
    ``outputs``), optional ``rewards``/``scores`` (one a sample), ``step`` (default 0), ``prompt_id``."""
    for f in _sample_files(path):
        for lineno, r in iter_jsonl(f):
            key = next((k for k in SAMPLES_KEYS if k in r), None)
            if "prompt" not in r or key is None or not isinstance(r[key], list) or not r[key]:
                raise TraceError(f"{f}:{lineno}: an evaluation dump line needs `prompt` and a non-empty list "
                                 f"`samples` (or one of {list(SAMPLES_KEYS[1:])})")
            rkey = next((k for k in REWARDS_KEYS if k in r), None)
            rewards = r[rkey] if rkey else [math.nan] * len(r[key])
            if not isinstance(rewards, list) or len(rewards) != len(r[key]):
                raise TraceError(f"{f}:{lineno}: `{rkey}` has {len(rewards) if isinstance(rewards, list) else 'no'} "
                                 f"entries for {len(r[key])} samples; give one reward a sample")
            try:
                step = int(r.get("step", 0))
            except (TypeError, ValueError):
                raise TraceError(f"{f}:{lineno}: `step` must be an integer, got {r.get('step')!r}") from None
            yield f, lineno, r["prompt"], r[key], rewards, step, r.get("prompt_id")


def read_samples(path: Path, tokenizer, add_special_tokens: bool = True,
                 tool_pattern: str | None = TOOL_RESPONSE_PATTERN) -> dict[int, "object"]:
    """step -> DataFrame, as ``read_dump``, of an evaluation dump (``_sample_records``); every line
    is one prompt's samples, and a prompt seen again at the same step adds samples after its first."""
    import pandas as pd
    data: dict[int, list[dict]] = {}
    seen: dict[tuple[int, str], int] = {}
    tools = tool_regex(tool_pattern)
    for f, lineno, prompt, samples, rewards, step, given_id in _sample_records(path):
        prompt = _text(prompt, f, f":{lineno}", tokenizer, True)
        key, pids = _prompt_ids(prompt, tokenizer, add_special_tokens)
        pid = str(given_id) if given_id is not None else _prompt_id(key)
        for text, reward in zip(samples, rewards):
            output = _text(text, f, f":{lineno}", tokenizer, False, tools)
            idx = seen.get((step, pid), 0)
            seen[(step, pid)] = idx + 1
            data.setdefault(step, []).append(
                {"prompt_id": pid, "sample_idx": idx, "prompt_text": key, "prompt_token_ids": pids,
                 **_output_row(output, tokenizer), "logprobs": None,
                 "reward": float(reward) if reward is not None else math.nan, "retokenized": True})
    return {step: pd.DataFrame(rows) for step, rows in sorted(data.items())}


def _prompt_id(key: str) -> str:
    import hashlib
    return "h" + hashlib.sha1(key.encode()).hexdigest()[:12]


def _prompt_ids(prompt, tokenizer, add_special_tokens: bool) -> tuple[str, list[int]]:
    """The prompt's identity text and its token ids (text is tokenized; a chat prompt came as ids)."""
    key = prompt if isinstance(prompt, str) else json.dumps(prompt)
    ids = prompt if not isinstance(prompt, str) else tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
    return key, [int(t) for t in ids]


def read_dump(directory: Path, fmt: str, tokenizer, add_special_tokens: bool = True,
              tool_pattern: str | None = TOOL_RESPONSE_PATTERN) -> dict[int, "object"]:
    """step -> DataFrame (prompt_id, sample_idx, token_ids, tool_tokens, prompt_token_ids, prompt_text,
    reward, retokenized) of a verl, TRL or evaluation (``samples``) dump; every problem is one
    TraceError naming the file. Multi-turn rollouts keep only the policy's turns
    (``bench.traces.conversations``; ``tool_tokens``: what was left out)."""
    import pandas as pd
    if fmt == "samples":
        return read_samples(directory, tokenizer, add_special_tokens, tool_pattern)
    tools = tool_regex(tool_pattern)
    out = {}
    for step, f in _dump_files(Path(directory), fmt).items():
        records, where = _dump_records(f, fmt, step)
        rewards = _dump_rewards(records, fmt)
        seen: dict[str, int] = {}
        data = []
        for i, r in enumerate(records):
            prompt = _text(r["input"] if fmt == "verl" else r["prompt"], f, where(i), tokenizer, True)
            output = _text(r["output"] if fmt == "verl" else r["completion"], f, where(i), tokenizer, False, tools)
            key, pids = _prompt_ids(prompt, tokenizer, add_special_tokens)
            pid = _prompt_id(key)
            idx = seen.get(pid, 0)  # the n samples of a prompt, by order
            seen[pid] = idx + 1
            data.append({"prompt_id": pid, "sample_idx": idx, "prompt_text": key,
                         "prompt_token_ids": pids, **_output_row(output, tokenizer),
                         "logprobs": None, "reward": rewards[i], "retokenized": True})
        out[step] = pd.DataFrame(data)
    return out


def write_dump_log(steps: dict[int, "object"], out: Path) -> Path:
    """A simulation log folder (``step_<N>.parquet``) for ``python -m bench.harness.simulate``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise TraceError(f"--log-out {out} exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    for step, df in steps.items():
        df.drop(columns=["prompt_text"]).to_parquet(out / f"step_{step:05d}.parquet", index=False)
    (out / "README.txt").write_text(RETOKENIZED_NOTE + "\n")
    return out


def dump_prompts(steps: dict[int, "object"]) -> list[dict]:
    """The prompt records (as ``bench.traces.importer.read_prompts`` gives them) of a read dump."""
    prompts: dict[str, dict] = {}
    for df in steps.values():
        for pid, ids, text in zip(df["prompt_id"], df["prompt_token_ids"], df["prompt_text"]):
            prompts.setdefault(pid, {"prompt_id": pid, "token_ids": list(ids), "steps": None,
                                     "meta": {"text": text}})
    return list(prompts.values())
