"""``python -m bench.knobs``: print the knob tables, or regenerate docs/methods.md from the schemas.

    python -m bench.knobs                 # every method's knobs (as python -m bench.harness.cli --knobs)
    python -m bench.knobs docs --write    # docs/methods.md, rewritten from bench/knobs/
    python -m bench.knobs docs --check    # exit 1 when docs/methods.md is stale
"""
from __future__ import annotations

import argparse
import sys

from bench.core.paths import DOCS_DIR
from bench.knobs.listing import docs_text, knobs_text

DOCS = DOCS_DIR / "methods.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.knobs", description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["knobs", "docs"], default="knobs")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="docs: rewrite docs/methods.md")
    mode.add_argument("--check", action="store_true", help="docs: exit 1 when docs/methods.md differs")
    args = parser.parse_args(argv)
    if args.what == "knobs":
        print(knobs_text(), end="")
        return 0
    text = docs_text()
    if args.write:
        DOCS.write_text(text)
        print(f"wrote {DOCS.name} ({len(text.splitlines())} lines)", file=sys.stderr)
        return 0
    if args.check:
        same = DOCS.exists() and DOCS.read_text() == text
        print("docs/methods.md is current" if same else "docs/methods.md is stale: python -m bench.knobs docs "
              "--write", file=sys.stderr)
        return 0 if same else 1
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
