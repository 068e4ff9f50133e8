"""``python -m bench.train``: see :mod:`bench.train.cli`."""
from bench.train.cli import main

main()
