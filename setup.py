"""The one compiled part: the tree drafters' suffix automaton (methods/suffix/_compiled.c).

Optional: where no C compiler is at hand the install goes on without it and the drafters run on
the pure-Python index (methods/suffix/compiled.py says so). Everything else is in pyproject.toml.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("methods.suffix._compiled", ["methods/suffix/_compiled.c"], optional=True,
                             extra_compile_args=["-O2", "-ffp-contract=off"])])
