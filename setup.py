"""The native part of the package: built when a C compiler is there, and optional (the reader falls back to Python)."""

from setuptools import Extension, setup

NATIVE = "csrc/dcp_pickle"  # the sources of tensormorph.formats._dcp_pickle

setup(ext_modules=[Extension("tensormorph.formats._dcp_pickle", [f"{NATIVE}/machine.c", f"{NATIVE}/summary.c"],
                             depends=[f"{NATIVE}/reader.h"], optional=True)])
