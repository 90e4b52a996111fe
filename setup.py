"""The native part of the package: built when a C compiler is there, and optional (the reader falls back to Python)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tensormorph.formats._dcp_pickle", ["src/tensormorph/formats/_dcp_pickle.c"],
                             optional=True)])
