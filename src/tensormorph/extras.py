"""Optional dependencies: a feature that needs one imports it through `require`, which says in one line which
extra installs it (a MissingDependencyError, which the CLI prints as one line, exit 2) instead of a traceback.

    torch = require("torch", "torch", feature="tm.load")
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

# URL schemes whose fsspec implementation is a separate package that an extra installs
PROTOCOL_PACKAGES = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3")}


def require(module: str, extra: str | None, *, feature: str | None = None) -> ModuleType:
    """`module`, imported; MissingDependencyError naming the extra that installs it (None: the base install, which
    a broken environment may lack) when it, or a package it imports, is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or module
        ours = module == missing or module.startswith(missing + ".")
        what = f"{module} is not installed" if ours else f"{module} is installed, but its dependency {missing} is not"
        package, needs = (f"tensormorph[{extra}]", f"the {extra!r} extra") if extra else ("tensormorph", module)
        raise MissingDependencyError(f"{feature or module} needs {needs} ({what}): pip install '{package}'") from None


def require_for_url(url: str, *, feature: str | None = None) -> ModuleType:
    """fsspec, and the package that implements `url`'s scheme where an extra provides it (s3fs for s3://)."""
    what = feature or url
    fsspec = require("fsspec", "s3", feature=what)
    package = PROTOCOL_PACKAGES.get(url.split("://", 1)[0].lower())
    if package is not None:
        require(*package, feature=what)
    return fsspec
