"""The native parts of the package, built where a C compiler is: both optional (the package falls back to Python's
unpickler and to zfec's own coding without them)."""

from setuptools import Extension, setup

DCP_PICKLE = "csrc/dcp_pickle"  # the sources of tensormorph.formats._dcp_pickle

setup(ext_modules=[
    Extension("tensormorph.formats._dcp_pickle", [f"{DCP_PICKLE}/machine.c", f"{DCP_PICKLE}/summary.c"],
              depends=[f"{DCP_PICKLE}/reader.h"], optional=True),
    Extension("tensormorph.tmformat._gf256", ["csrc/gf256/gf256.c"], optional=True),
])
