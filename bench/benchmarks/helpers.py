"""What every benchmark shares: a random-weight policy of a given shape, synthetic requests,
interleaved timing of a call, a measured subprocess (wall seconds and peak RSS), one parser per
benchmark, a markdown table of rows and one row printed. Kept here so the benchmark modules stay one subject each."""
from __future__ import annotations
import argparse
import tempfile
import time
from pathlib import Path
from methods.base import RolloutKey
from bench.core.engine_protocol import Request


def tiny_policy(out: Path, vocab: int = 64, hidden: int = 128, layers: int = 4, heads: int = 2,
                scale: float = 1.0) -> Path:
    """A random-init Llama of about 1M parameters (the size docs/engines.md's CPU figures use) with no EOS token, so
    every rollout runs to max_new_tokens and both engines do the same work; ``scale`` multiplies
    the output layer (sharper next-token distributions)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=1024, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(str(out))
    GenerationConfig(bos_token_id=0, pad_token_id=0).save_pretrained(str(out))
    return out


def synthetic_requests(batch: int, prompt_len: int = 16) -> list[Request]:
    return [Request(RolloutKey(f"p{i}", 0), [1 + (i * 7 + j) % 60 for j in range(prompt_len)]) for i in range(batch)]


def time_call(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def run_measured(cmd: list[str], timeout: float) -> dict:
    """Wall seconds, peak RSS (MB, the child's own ru_maxrss), exit status, stdout and the last
    line of stderr of a command."""
    import os
    import subprocess
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        deadline = t + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status = os.waitstatus_to_exitcode(status)
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                status = -9
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t
        out.seek(0)
        text = out.read()
        err.seek(0)
        last = ([ln for ln in err.read().splitlines() if ln.strip() and "it/s" not in ln] or [""])[-1]
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "status": status, "stdout": text,
            "error": last if status else ""}


def print_rows(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


def print_row(row: dict, json_path: str | None = None) -> None:
    """One measurement as aligned ``name: value`` lines; also written to ``json_path`` when given."""
    width = max(len(k) for k in row)
    for k, v in row.items():
        print(f"{k:>{width}}: {v:.3f}" if isinstance(v, float) else f"{k:>{width}}: {v}")
    if json_path:
        import json
        Path(json_path).write_text(json.dumps(row, indent=1) + "\n")


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of one benchmark, named as the command runs it."""
    return argparse.ArgumentParser(prog=f"python -m bench.benchmarks {name}", description=description)


def torch_setup(threads: int) -> None:
    """Every torch benchmark: no autograd, a fixed number of CPU threads for every contender."""
    import torch
    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)
