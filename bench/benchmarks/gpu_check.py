"""The GPU check: one offline command for a machine with a GPU, run once per lent session.

    python -m bench.benchmarks.gpu_check --out results/gpu_check          # on the GPU machine
    python -m bench.benchmarks.gpu_check --device cpu --small --out gpu_check_dry  # a dry run of the same steps on CPU

It (1) runs the gpu-marked tests, (2) replays the tiny trace with baseline and every method on
each engine importable here (torch_ref always; vLLM and SGLang when installed, else a one-line
notice), and (3) profiles latency tables of the torch engine's own forward path (slot KV cache,
4D mask, ragged block) in bf16 on random-init models of Qwen2.5-0.5B shape and of Qwen2.5-7B
shape cut to 4 layers, over live rows 1..256 x 0..24 draft tokens at a 1,024-token context: the
CSVs ``python -m bench.benchmarks latency predict RUN --table`` reads, and the cost of verifying k tokens
relative to one decode step. Everything goes to --out (tables as Markdown and CSV, the pytest
log); the summary is printed. About 5 minutes on one H200 (most of it the 7B-shape table). Needs no network, but
needs the suite's Python dependencies: a GPU machine that has only torch and transformers also
needs the small pure-Python wheels of hydra-core, omegaconf and antlr4-python3-runtime copied
over and installed (pip install --no-deps *.whl) before it runs.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.core.paths import CONF_DIR

ENGINES = ("torch_ref", "vllm", "sglang")


def run_gpu_tests(out: Path) -> str:
    """pytest -m gpu; its log is kept, its closing line returned."""
    res = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests"],
                         capture_output=True, text=True)
    (out / "pytest_gpu.log").write_text(res.stdout + res.stderr)
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    return lines[-1] if lines else f"pytest exited {res.returncode} with no output"


def replay_engines(out: Path, device: str, max_steps: int | None) -> list[str]:
    """The tiny trace, every method, on every importable engine; returns the report lines."""
    notes = []
    runs = out / "runs"
    for engine in ENGINES:
        if engine != "torch_ref" and importlib.util.find_spec(engine) is None:
            notes.append(f"engine {engine}: skipped ({engine} is not installed here)")
            continue
        args = [sys.executable, "-m", "bench.harness.cli", "trace=countdown_tiny", f"engine={engine}",
                f"results_root={runs}", "plots=false", "progress=false"]
        if engine in ("torch_ref", "sglang"):
            args.append(f"engine.device={device}")
        if max_steps:
            args.append(f"max_steps={max_steps}")
        if engine == "sglang":  # its adapter covers baseline and prefix reuse (+ NGRAM on GPU)
            args.append("method=[baseline,prefix_reuse,prefix_reuse_exact,tree_cache]")
        t = time.perf_counter()
        res = subprocess.run(args, capture_output=True, text=True)
        (out / f"replay_{engine}.log").write_text(res.stdout + res.stderr)
        status = "ok" if res.returncode == 0 else f"FAILED (exit {res.returncode}, see replay_{engine}.log)"
        notes.append(f"engine {engine}: {status} in {time.perf_counter() - t:.0f} s")
    if runs.exists():
        from bench.report.collect import collect, report
        col = collect([runs], progress=False)
        (out / "engines.md").write_text(report(col))
        col.table.to_csv(out / "engines.csv", index=False)
    return notes


# (model shape, layers kept): the full Qwen2.5-0.5B, and Qwen2.5-7B cut to 4 of its 28 layers (a
# pass of the full model costs about 28/4 x the layer part of the cut one; the LM head is whole)
GPU_SHAPES = (("qwen2.5-0.5b", None), ("qwen2.5-7b", 4))
SMALL_SHAPE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
               "tie_word_embeddings": True}


def shape_checkpoint(out: Path, shape: str | None, layers: int | None) -> Path:
    """A random-init Qwen2 checkpoint of a bundled shape (conf/model_shape), layers cut if asked."""
    import yaml
    from transformers import Qwen2Config, Qwen2ForCausalLM
    fields = dict(SMALL_SHAPE) if shape is None else \
        yaml.safe_load((CONF_DIR / "model_shape" / f"{shape}.yaml").read_text())
    if layers:
        fields["num_hidden_layers"] = layers
    cfg = Qwen2Config(**fields, max_position_embeddings=4096, eos_token_id=1, bos_token_id=0, pad_token_id=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    path = out / f"model_{shape or 'small'}{f'_{layers}L' if layers else ''}"
    model.save_pretrained(str(path))
    return path


def latency_tables(out: Path, device: str, small: bool, context: int = 1024) -> list[str]:
    """The engine's own forward path (slot KV cache, 4D mask, ragged block; bench.spec.latency) in bf16
    (float32 on CPU) over live rows 1..256 x 0..24 draft tokens per row, one latency-table CSV
    per model shape (``python -m bench.benchmarks latency predict RUN --table`` reads them)."""
    from bench.engines.torch.engine import TorchRefEngine
    from bench.engines.torch.timing import profile
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    shapes = ((None, None),) if small else GPU_SHAPES
    rows = (1, 4, 16) if small else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    query = (1, 2, 5, 9) if small else (1, 2, 3, 5, 9, 17, 25)
    context = 64 if small else context
    lines = []
    for shape, layers in shapes:
        t = time.perf_counter()
        engine = TorchRefEngine(device=device, dtype=dtype, threads=None if device.startswith("cuda") else 2)
        engine.load(shape_checkpoint(out, shape, layers))
        table = profile(engine, rows, query, (context,), repeats=5, progress=False)
        name = f"{shape or 'small'}{f'-{layers}L' if layers else ''}"
        table["model"] = f"{name}: " + table["model"]
        table.to_csv(out / f"latency_{name}.csv", index=False)
        pivot = table.pivot(index="query", columns="rows", values="seconds")
        ratio = pivot / pivot.loc[1]  # a pass over 1 + k tokens per row vs one decode step, same rows
        ratio.index = [f"k={q - 1}" for q in ratio.index]
        lines.append(f"\nverify cost (pass over 1+k tokens per row / one decode step) by live rows, "
                     f"{name} ({table['model'].iat[0]}), {dtype}, context {context}, "
                     f"{time.perf_counter() - t:.0f} s:\n")
        lines.append(ratio.round(2).to_string())
        lines.append("decode step ms by live rows: " + ", ".join(
            f"{r}: {1e3 * v:.2f}" for r, v in pivot.loc[1].items()))
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/gpu_check"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a small model and fewer batches (dry runs)")
    ap.add_argument("--max-steps", type=int, default=None, help="replay only the first N trace steps")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run on a GPU machine, or pass --device cpu --small for a dry run")
    out = args.out / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    lines = [f"# GPU check {time.strftime('%Y-%m-%d %H:%M')}: device {args.device} ({gpu}), torch {torch.__version__}"]
    t0 = time.perf_counter()
    lines.append(f"gpu-marked tests: {run_gpu_tests(out)}")
    lines += replay_engines(out, args.device, args.max_steps)
    lines += latency_tables(out, args.device, args.small)
    if (out / "engines.md").exists():
        lines.append("\n" + (out / "engines.md").read_text())
    lines.append(f"\ntotal {time.perf_counter() - t0:.0f} s; files in {out}")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
