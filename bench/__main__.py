"""``python -m bench``: the main job (the same command as ``python -m bench.harness.cli``, with
the same Hydra overrides), so the quick start needs no module path."""
from bench.harness.cli import main

if __name__ == "__main__":
    main()
