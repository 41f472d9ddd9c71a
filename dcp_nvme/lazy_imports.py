"""Deferred and optional imports: names of a package that load on first use, so that light entry
points (``dcp-nvme --help``) start without importing torch; and optional dependencies (the
trainers of ``dcp_nvme.integrations``), whose absence names the package to install."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any


def lazy_names(package: str, namespace: dict[str, Any],
               table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
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


def require(module: str, *, needed_by: str, install: str) -> ModuleType:
    """``module``, an optional dependency of ``needed_by``, imported now. When ``module`` or a
    package above it is not installed, raises ModuleNotFoundError (an ImportError) saying so:
    ``"dcp_nvme.integrations.lightning needs lightning: pip install lightning"``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        parts = module.split(".")
        if exc.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            raise  # the module is installed but one of its own imports is missing: its error says which
        raise ModuleNotFoundError(f"{needed_by} needs {install}: pip install {install}", name=exc.name) from exc
