"""Every reference resolves inside the repository: a path such as ``bench/core/verify.py`` or
``docs/design.md`` named in code, configs, docs or the README exists, and every
``python -m bench...`` command names a module that imports. ``results/LOG.md`` is exempt: it is
a dated log, and its older entries name the layout of their day (docs/architecture.md maps them).
Outputs a command writes (``results/runs``, ``results/figures/...``) and placeholders in capitals
(``conf/method/NAME.yaml``) are not references."""
import importlib.util
import os
import re
from pathlib import Path

from bench.core.paths import REPO_ROOT

SUFFIXES = {".py", ".md", ".yaml", ".sh", ".toml", ".ipynb", ".cfg"}
SKIP_PARTS = {".git", "__pycache__", "bundled", "runs", "node_modules"}
PATH = re.compile(r"(?<![\w./-])((?:bench|methods|tests|conf|docs|rigs|notebooks|\.ci)/[\w/.\-]*\w)")
MODULE = re.compile(r"python -m ((?:bench|methods)(?:\.\w+)*)")


HISTORY = {"results/LOG.md": None,  # the dated log: whole
           "docs/architecture.md": "## Where each module went",  # its map of the old layout
           "tests/test_references.py": None}  # this test's own counter-examples


def _files():
    for folder, dirs, names in os.walk(REPO_ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_PARTS and not d.startswith(".venv")]
        for name in names:
            path = Path(folder) / name
            rel = path.relative_to(REPO_ROOT)
            if not (path.suffix in SUFFIXES or rel.parent.as_posix() == ".ci"):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if rel.as_posix() in HISTORY:
                if HISTORY[rel.as_posix()] is None:
                    continue
                text = text.split(HISTORY[rel.as_posix()])[0]
            yield rel, text


def _dangling(text: str) -> list[str]:
    out = []
    for match in PATH.finditer(text):
        ref = match.group(1).rstrip(".")
        if text[match.end():match.end() + 1] in ("-", "*", "{", "<") or any(c in ref for c in "*<{") or re.search(r"/[A-Z_]+(\.\w+)?$", ref):
            continue
        if not (REPO_ROOT / ref).exists() and not (REPO_ROOT / ref).with_suffix("").exists():
            out.append(f"path {ref}")
    for match in MODULE.finditer(text):
        if importlib.util.find_spec(match.group(1)) is None:
            out.append(f"module {match.group(1)}")
    return out


def test_every_named_path_and_module_exists():
    bad = [f"{rel}: {what}" for rel, text in _files() for what in _dangling(text)]
    assert not bad, "references that do not resolve (fix the name, or the file moved):\n" + "\n".join(sorted(set(bad)))


def test_the_check_sees_a_dangling_reference():
    assert _dangling("see bench/no_such_module.py and python -m bench.no_such_command") == [
        "path bench/no_such_module.py", "module bench.no_such_command"]
    assert _dangling("see bench/core/verify.py, conf/method/NAME.yaml and python -m bench.harness.simulate") == []
