"""The GPU check: one offline command for a machine with a GPU, run once per lent session.

    python -m bench.gpu_check --out results/gpu_check          # on the GPU machine
    python -m bench.gpu_check --device cpu --small --out gpu_check_dry  # a dry run of the same steps on CPU

It (1) runs the gpu-marked tests, (2) replays the tiny trace with baseline and every method on
each engine importable here (torch_ref always; vLLM and SGLang when installed, else a one-line
notice), and (3) measures the verification cost curve on a random-init Llama of a few hundred
million parameters made on the spot: a forward pass over k+1 tokens (k draft tokens) relative to
one decode step, for batch 1 to 256, with a 512-token context. Everything goes to --out
(tables as Markdown and CSV, the pytest log); the summary is printed. Needs no network, but
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
        args = [sys.executable, "-m", "bench.cli", "trace=countdown_tiny", f"engine={engine}",
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
        from .collect import collect, report
        col = collect([runs], progress=False)
        (out / "engines.md").write_text(report(col))
        col.table.to_csv(out / "engines.csv", index=False)
    return notes


def cost_model(small: bool):
    """A random-init Llama: ~300M parameters (small: ~10M, for dry runs)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if small:
        cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=20,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def verification_cost(device: str, small: bool, batches=(1, 4, 16, 64, 256), ks=(0, 1, 2, 4, 8, 16),
                      context: int = 512, repeats: int = 5) -> list[dict]:
    """Seconds of a forward over k+1 new tokens per row on a ``context``-token KV cache, and the
    ratio to one decode step (k = 0) at the same batch: what a k-token draft costs to verify."""
    from transformers import DynamicCache
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = cost_model(small).to(device=device, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    rows = []
    with torch.inference_mode():
        for batch in batches if not small else batches[:3]:
            ctx = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
            base = None
            for k in ks:
                times = []
                for _ in range(repeats + 1):  # the first one warms up
                    cache = DynamicCache(config=model.config)
                    model(input_ids=ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    new = torch.randint(0, model.config.vocab_size, (batch, k + 1), device=device)
                    _sync(device)
                    t = time.perf_counter()
                    model(input_ids=new, past_key_values=cache, use_cache=True)
                    _sync(device)
                    times.append(time.perf_counter() - t)
                sec = sorted(times[1:])[len(times[1:]) // 2]
                base = sec if k == 0 else base
                rows.append({"params_m": round(params / 1e6), "batch": batch, "draft_tokens": k,
                             "forward_ms": 1e3 * sec, "vs_decode_step": sec / base})
    return rows


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
    import pandas as pd
    curve = pd.DataFrame(verification_cost(args.device, args.small))
    curve.to_csv(out / "verification_cost.csv", index=False)
    pivot = curve.pivot(index="draft_tokens", columns="batch", values="vs_decode_step")
    lines.append("\nverification cost (forward over k+1 tokens / one decode step), "
                 f"{curve['params_m'].iat[0]}M-parameter Llama, 512-token context:\n")
    lines.append(pivot.to_markdown(floatfmt=".2f") if _has_tabulate() else pivot.round(2).to_string())
    if (out / "engines.md").exists():
        lines.append("\n" + (out / "engines.md").read_text())
    lines.append(f"\ntotal {time.perf_counter() - t0:.0f} s; files in {out}")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    print(text)


def _has_tabulate() -> bool:
    return importlib.util.find_spec("tabulate") is not None


if __name__ == "__main__":
    main()
