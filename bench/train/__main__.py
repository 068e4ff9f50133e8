"""``python -m bench.train``: see :mod:`bench.train.cli`."""
from .cli import main

main()
