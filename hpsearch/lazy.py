"""Packages that import their parts on first use (PEP 562): reading and checking a config need not import torch."""
from __future__ import annotations

import importlib


def lazy_names(package: str, where: dict[str, str]):
    """(`__getattr__`, `__dir__`) for `package`, whose public names live in its submodules: `where` maps each name
    to the submodule defining it. A name is imported when first read, then kept in the package's namespace."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
