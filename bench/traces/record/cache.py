"""Find or record a named trace in the local cache, atomically, so tests and benchmarks share one.

    python -c "from bench.traces.record.cache import ensure_trace; print(ensure_trace('countdown-tiny', tiny=True))"

The cache root is ``$SPECROLLOUT_CACHE`` (default ``~/.cache/specrollout``); named traces live in
``<root>/traces/<name>``. A trace is recorded into a temporary sibling dir and renamed into place
when complete, so a killed recording never leaves a half trace that looks complete.

A trace recorded in advance may ship in the package (``bench/traces/record/bundled/<name>``, the
"embedded default"): a cache name whose bundled copy was recorded by this recorder version with
the same settings is copied into the cache instead of recorded (seconds, not minutes). With other
settings (or without the folder, as in an install that left it out) it is recorded as before.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import yaml

from bench.core.paths import cache_root
from bench.traces.format import MANIFEST
from bench.core.publish import replace_dir
from bench.traces.record.grpo import RECORDER_VERSION, RecordConfig, SearchRecordConfig
from bench.traces.record.smollm2 import SmolLM2RecordConfig

BUNDLED = Path(__file__).resolve().parent / "bundled"  # traces recorded in advance, by cache name
PRESETS = {"countdown": RecordConfig, "countdown-tiny": RecordConfig.tiny,
           "countdown-search": SearchRecordConfig, "countdown-search-tiny": SearchRecordConfig.tiny,
           "smollm2-word-problems": SmolLM2RecordConfig, "smollm2-word-problems-tiny": SmolLM2RecordConfig.tiny}


def _config_for(name: str, tiny: bool) -> RecordConfig:
    base = (SearchRecordConfig if name.startswith("countdown-search")  # the reasoning trace
            else SmolLM2RecordConfig if name.startswith("smollm2") else RecordConfig)  # the real model's
    if tiny:
        return base.tiny(name=name)
    return PRESETS[name]() if name in PRESETS else base(name=name)


def _is_current(path: Path, cfg: RecordConfig) -> bool:
    """A complete trace recorded by this recorder version with the same settings."""
    try:
        rec = (yaml.safe_load((path / MANIFEST).read_text()) or {}).get("recorder") or {}
    except (OSError, yaml.YAMLError):
        return False
    return rec == {"version": RECORDER_VERSION, **asdict(cfg)}


def bundled_trace(name: str, cfg: RecordConfig) -> Path | None:
    """The trace of cache name ``name`` shipped in the package, if it matches ``cfg`` (else None)."""
    path = BUNDLED / name
    return path if (path / MANIFEST).exists() and _is_current(path, cfg) else None


def ensure_trace(name_or_dir: str | os.PathLike, tiny: bool = False, progress: bool = True) -> Path:
    """Return the path of a complete trace, recording it first if absent or stale.

    ``name_or_dir`` is a cache name (``"countdown"``, ``"countdown-tiny"``, ``"countdown-search"``
    (the long-tailed reasoning trace), ``"smollm2-word-problems"`` (the real model's), or any name: recorded
    with the default settings, or the tiny ones when ``tiny``; a name with a current bundled
    recording is copied from the package instead) or a directory path. A directory
    that holds a trace is returned as it is; a cached trace recorded by an older recorder version
    or with other settings is recorded again and replaced.
    """
    text = os.fspath(name_or_dir)
    is_path = os.sep in text or text.startswith(".") or Path(text).is_absolute()
    target = Path(text).expanduser() if is_path else cache_root() / "traces" / text
    cfg = _config_for(target.name, tiny)
    if (target / MANIFEST).exists():
        manifest = yaml.safe_load((target / MANIFEST).read_text()) or {}
        if is_path or "recorder" not in manifest or _is_current(target, cfg):
            return target  # a cached trace of an older recorder or other settings is re-recorded
    elif target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists but holds no {MANIFEST}: it is not a trace; delete it or "
                              f"choose another directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.recording-", dir=target.parent))
    try:
        bundled = bundled_trace(target.name, cfg) if not is_path else None
        if bundled is not None:  # recorded in advance with these settings: copy, do not record
            shutil.copytree(bundled, tmp, dirs_exist_ok=True)
            if progress:
                print(f"trace {target.name!r}: the bundled recording ({bundled}) copied to {target}")
        else:
            from bench.traces.record.grpo import record
            record(tmp, cfg, progress=progress)
        replace_dir(tmp, target, lambda t: (t / MANIFEST).exists() and _is_current(t, cfg))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
