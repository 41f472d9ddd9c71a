"""Names of a package that load on first use, so that light entry points (``dcp-nvme --help``)
start without importing torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, namespace: dict[str, Any], table: dict[str, str]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``table`` (name -> relative module)
    is imported on first access and then kept in the package's ``namespace``."""

    def getattr_(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(table))

    return getattr_, dir_
