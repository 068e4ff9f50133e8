"""Where things are, named once: the repository's own folders (the Hydra configs, the docs) and the
cache every derived artifact goes to (recorded traces, converted checkpoints, latency tables).

The suite is installed editable (``pip install -e``), so these are the checkout's folders.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"
METHOD_CONF_DIR = CONF_DIR / "method"
DOCS_DIR = REPO_ROOT / "docs"


def cache_root() -> Path:
    """The cache folder: ``$SPECROLLOUT_CACHE``, or ~/.cache/specrollout."""
    return Path(os.environ.get("SPECROLLOUT_CACHE") or Path.home() / ".cache" / "specrollout")
