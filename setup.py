"""The compiled parts: the tree drafters' suffix automaton (methods/suffix/_compiled.c) and the
one loop's per-row work (bench/spec/_rows.c).

Optional: where no C compiler is at hand the install goes on without them, and the drafters run
on the pure-Python index and the loop on its Python reference (methods/suffix/compiled.py and
bench/spec/compiled_rows.py say so). Everything else is in pyproject.toml.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("methods.suffix._compiled", ["methods/suffix/_compiled.c"], optional=True,
                             extra_compile_args=["-O2", "-ffp-contract=off"]),
                   Extension("bench.spec._rows", ["bench/spec/_rows.c"], optional=True, extra_compile_args=["-O2"])])
