"""Lazy exports for the package `__init__` files (PEP 562): a name's module is imported on first use, so importing
a package stays light (no JAX). Imports nothing of spmdkit's, so every layer may use it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """`__getattr__, __dir__, __all__` for `package`: each name of `exports` (public name -> the module that defines
    it) is imported on first use and kept in the package's namespace; `__all__` is the sorted names. An unknown name
    raises AttributeError.

        __getattr__, __dir__, __all__ = lazy_exports(__name__, {"make_mesh": "spmdkit.sharding.mesh"})
    """
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__, names
