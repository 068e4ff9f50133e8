"""Find or record a named trace in the local cache, atomically, so tests and benchmarks share one.

    python -c "from bench.record import ensure_trace; print(ensure_trace('countdown-tiny', tiny=True))"

The cache root is ``$SPECROLLOUT_CACHE`` (default ``~/.cache/specrollout``); named traces live in
``<root>/traces/<name>``. A trace is recorded into a temporary sibling dir and renamed into place
when complete, so a killed recording never leaves a half trace that looks complete.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import yaml

from ..trace import MANIFEST
from .grpo import RECORDER_VERSION, RecordConfig

PRESETS = {"countdown": RecordConfig, "countdown-tiny": RecordConfig.tiny}


def cache_root() -> Path:
    return Path(os.environ.get("SPECROLLOUT_CACHE") or Path.home() / ".cache" / "specrollout")


def _config_for(name: str, tiny: bool) -> RecordConfig:
    if tiny:
        return RecordConfig.tiny(name=name)
    return PRESETS[name]() if name in PRESETS else RecordConfig(name=name)


def _is_current(path: Path, cfg: RecordConfig) -> bool:
    """A complete trace recorded by this recorder version with the same settings."""
    try:
        rec = (yaml.safe_load((path / MANIFEST).read_text()) or {}).get("recorder") or {}
    except (OSError, yaml.YAMLError):
        return False
    return rec == {"version": RECORDER_VERSION, **asdict(cfg)}


def ensure_trace(name_or_dir: str | os.PathLike, tiny: bool = False, progress: bool = True) -> Path:
    """Return the path of a complete trace, recording it first if absent or stale.

    ``name_or_dir`` is a cache name (``"countdown"``, ``"countdown-tiny"``, or any name: recorded
    with the default settings, or the tiny ones when ``tiny``) or a directory path. A directory
    that holds a trace not made by this recorder (e.g. an imported one) is returned as it is.
    """
    text = os.fspath(name_or_dir)
    is_path = os.sep in text or text.startswith(".") or Path(text).is_absolute()
    target = Path(text).expanduser() if is_path else cache_root() / "traces" / text
    cfg = _config_for(target.name, tiny)
    if (target / MANIFEST).exists():
        manifest = yaml.safe_load((target / MANIFEST).read_text()) or {}
        if "recorder" not in manifest or _is_current(target, cfg):
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.recording-", dir=target.parent))
    try:
        from .grpo import record
        record(tmp, cfg, progress=progress)
        if target.exists():  # stale (or a concurrent recorder finished first): swap it out
            if _is_current(target, cfg):
                shutil.rmtree(tmp)
                return target
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            os.replace(target, old / "trace")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
