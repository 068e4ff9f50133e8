"""Where the repository's own folders are, named once: the Hydra configs (``conf/``) and the docs.

The suite is installed editable (``pip install -e``), so these are the checkout's folders.
"""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"
METHOD_CONF_DIR = CONF_DIR / "method"
DOCS_DIR = REPO_ROOT / "docs"
