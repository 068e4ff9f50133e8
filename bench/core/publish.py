"""Publishing a finished directory in one rename, so a reader never sees a partial one: the trace
writer, the importer, the real model's conversion, merged delta checkpoints and warm starts all
build beside the target and publish here.

    python -m pytest -q tests/test_trace.py tests/test_deltas.py
"""
from __future__ import annotations

import os
from pathlib import Path


def publish_dir(tmp: Path, target: Path) -> None:
    """Rename a finished temp dir into place, with the permissions of a normally created dir."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    os.replace(tmp, target)


def replace_dir(tmp: Path, target: Path, is_current) -> None:
    """Publish the finished ``tmp`` as ``target``: an existing ``target`` that is not current (stale,
    partial) is moved aside and deleted first; when a concurrent writer published a current one in
    the meantime, ``tmp`` is dropped instead. ``is_current(target) -> bool``."""
    import shutil
    import tempfile
    if target.exists() and not is_current(target):
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        os.replace(target, old / target.name)
        shutil.rmtree(old, ignore_errors=True)
    try:
        publish_dir(tmp, target)
    except OSError:  # a concurrent writer published first
        if not is_current(target):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
