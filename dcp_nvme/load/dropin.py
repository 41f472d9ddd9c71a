"""What ``NVMeReader`` keeps of DCP's stock reader: FileSystemReader's arguments accepted where
they are what it does anyway, refused saying why otherwise (``reader_stock_options``)."""

from __future__ import annotations

from typing import Any

from dcp_nvme.config import refuse_positional, unknown_option
from dcp_nvme.errors import InvalidInputError

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
