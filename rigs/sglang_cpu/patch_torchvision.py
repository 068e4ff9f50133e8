"""Guards torchvision 0.28.0's two unconditional fake-op registrations, so it imports without its
compiled ops (its PyPI wheel is a CUDA build that does not load next to the CPU torch).

SpecRollout's SGLang CPU test rig; run by build.sh in the rig venv: python patch_torchvision.py.
Idempotent: a patched file is left as it is.
"""
import sys
from pathlib import Path

import importlib.util

MARK = "# specrollout-rig: registered only when torchvision's ops loaded"
OPS = ("torchvision::nms", "torchvision::qnms")


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        print("torchvision is not installed in this venv: nothing to patch", file=sys.stderr)
        return 1
    path = Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
    text = path.read_text()
    if MARK in text:
        print(f"{path}: already patched")
        return 0
    helper = (f"\n\n{MARK}\n"
              "def _register_fake_if_ops(op):\n"
              "    if torchvision.extension._has_ops():\n"
              "        return torch.library.register_fake(op)\n"
              "    return lambda fn: fn\n")
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in text:
        print(f"{path}: unexpected contents (not torchvision 0.28.0?): patch by hand", file=sys.stderr)
        return 1
    text = text.replace(anchor, anchor + helper, 1)
    for op in OPS:
        old = f'@torch.library.register_fake("{op}")'
        if old not in text:
            print(f"{path}: {old} not found (not torchvision 0.28.0?)", file=sys.stderr)
            return 1
        text = text.replace(old, f'@_register_fake_if_ops("{op}")', 1)
    path.write_text(text)
    print(f"{path}: guarded {', '.join(OPS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
