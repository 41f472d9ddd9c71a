"""Dropping in for DCP's stock storage classes: their keyword arguments, and where a checkpoint
may live. What a FileSystemReader/FileSystemWriter argument means here is decided in one place
(this module for the reader and the shared rules, ``save.dropin`` for the writer), so a user
who swaps the class keeps working or is told which of our options does that job: never a bare
``TypeError``."""

from __future__ import annotations

import inspect
import os
from typing import Any

from ..config import check_url, closest
from ..errors import InvalidInputError, UnknownOptionError
from ..storage.local_dir import is_remote_url, local_path


def options_of(cls: type) -> list[str]:
    """The keyword options of ``cls(...)``, as its signature names them."""
    return [p.name for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "path")]


def refuse_positional(cls: type, stock: str, names: tuple[str, ...], args: tuple[Any, ...]) -> None:
    """Options after the path are keyword-only: a stock positional call names what it meant."""
    if args:
        meant = ", ".join(f"{n}={v!r}" for n, v in zip(names, args)) or repr(args)
        raise UnknownOptionError(
            f"{cls.__name__} takes only the path positionally, got {len(args)} more argument(s) "
            f"({stock}'s positional order reads them as {meant}); pass options by keyword, e.g. "
            f"{cls.__name__}(path, overwrite=True)")


def unknown_option(cls: type, name: str, value: Any) -> UnknownOptionError:
    guess = closest(name, options_of(cls))
    hint = f"did you mean {guess}? " if guess else ""
    return UnknownOptionError(f"{cls.__name__} has no option {name}={value!r}; {hint}its options are "
                              f"{', '.join(options_of(cls))}")


STOCK_READER_POSITIONAL = ("_extension_registry",)


def reader_stock_options(cls: type, args: tuple[Any, ...], extra: dict[str, Any]) -> None:
    """FileSystemReader's arguments on NVMeReader: the stock defaults are accepted (they are
    what the reader does), anything else is refused saying why."""
    refuse_positional(cls, "FileSystemReader", STOCK_READER_POSITIONAL, args)
    for name, value in extra.items():
        if name == "_extension_registry":
            if value is not None:
                raise InvalidInputError(
                    f"{cls.__name__} reads no stream extensions (_extension_registry={value!r}): a "
                    "dcp_nvme checkpoint is plain safetensors, and a compressed mirror is decoded by "
                    "the reader itself")
            continue
        raise unknown_option(cls, name, value)


def _location_text(location: object, what: str, expected: str) -> str:
    """``location`` as a string; anything but a str or path is refused: "``what`` must be ``expected``"."""
    if not isinstance(location, (str, os.PathLike)):
        raise InvalidInputError(f"{what} must be {expected}, not {type(location).__name__} {location!r}")
    return os.fspath(location)


def reader_location(location: str | os.PathLike | None) -> str | None:
    """A reader's checkpoint: a local directory, or a URL fsspec can serve (read over fsspec)."""
    if location is None:
        return None
    text = _location_text(location, "a checkpoint location", "a path or URL")
    if is_remote_url(text):
        return check_url("checkpoint_id", text)
    return local_path(text)


def writer_location(location: str | os.PathLike | None) -> str | None:
    """A writer's checkpoint directory: local only. A URL is refused here, before anything is
    created, rather than becoming a local directory named after it (``./s3:/bucket/x``)."""
    if location is None:
        return None
    text = _location_text(location, "a checkpoint directory", "a path")
    if is_remote_url(text):
        name = text.rstrip("/").rsplit("/", 1)[-1] or "step_N"
        raise InvalidInputError(
            f"NVMeWriter saves to a local directory (node-local NVMe), not to {text}: save locally and "
            f"mirror there, NVMeWriter('/nvme/run/{name}', mirror={text!r}); the mirror drains in the "
            "background after each commit (NVMeReader loads from the URL directly)")
    return local_path(text)


def require_location(cls: type, location: str | None, call: str) -> str:
    """The checkpoint location, once DCP starts using the object; a clear error when none was given."""
    if location is None:
        raise InvalidInputError(
            f"{cls.__name__} has no checkpoint directory: give one, {cls.__name__}('/nvme/run/step_10'), or "
            f"pass checkpoint_id='/nvme/run/step_10' to {call}")
    return location
