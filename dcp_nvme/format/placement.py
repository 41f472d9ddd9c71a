"""Where each item goes in a container (pure: items to byte ranges, no I/O).

A container is one safetensors file per rank: an 8-byte little-endian header length, a JSON
header padded with spaces so the data region starts on an ``ALIGN`` boundary, then the items
in order. A host tensor large enough to matter starts at a data offset congruent to its memory
address (``place_congruent``), the gap before it a padding entry, so the aligned bulk of its
bytes can be written straight from its memory with O_DIRECT; only its unaligned head and tail
go through a bounce buffer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import ALIGN
from .container import build_header, is_pad_key, pad_key


def align_up(value: int, alignment: int = ALIGN) -> int:
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int = ALIGN) -> int:
    return value // alignment * alignment


def place_back_to_back(sizes: Sequence[int], alignments: Sequence[int] | None = None) -> tuple[list[int], int]:
    """Offsets of items laid one after the other, each rounded up to its alignment, and the end.

    A staging arena's layout, each dtype's itemsize the alignment (a typed view cannot start
    mid-element); a container without host addresses, no alignments. ``place_congruent`` puts
    an arena's items at their arena offsets in the container (its gaps become pad entries), so
    every write window is one span of the arena, written without a copy.
    """
    offsets, cursor = [], 0
    for index, size in enumerate(sizes):
        if alignments is not None:
            cursor = align_up(cursor, alignments[index])
        offsets.append(cursor)
        cursor += size
    return offsets, cursor


DIRECT_MIN = 64 << 10
"""Host items at least this large get a gap (< the congruence) to be written from their memory."""


ITEMSIZE_GAP = 16
"""Smaller items take a gap only below this (the largest itemsize): a staging arena's dtype
padding, so an arena's items keep their arena offsets and its windows stay one span."""


def place_congruent(
    sizes: Sequence[int], addresses: Sequence[int | None], congruence: int = ALIGN,
    threshold: int = DIRECT_MIN,
) -> tuple[list[int], int]:
    """Offsets of items in order, each at ``offset = address (mod congruence)`` when the gap that
    takes is worth it, else right after the item before; and the end.

    A gap is taken for an item with an address (host memory) and bytes: any gap below
    ``congruence`` when it holds ``threshold`` bytes or more, else only one below
    ``ITEMSIZE_GAP``. Sources laid out by ``place_back_to_back`` with itemsize alignments in one
    ``congruence``-aligned arena get exactly their arena offsets (relative to the first).
    """
    offsets, cursor = [], 0
    for size, address in zip(sizes, addresses, strict=True):
        if address is not None and size > 0:
            gap = (address - cursor) % congruence
            if gap < (congruence if size >= threshold else ITEMSIZE_GAP):
                cursor += gap
        offsets.append(cursor)
        cursor += size
    return offsets, cursor


@dataclass(frozen=True)
class ItemSpec:
    """One item as the safetensors header describes it."""

    key: str
    nbytes: int
    st_dtype: str
    st_shape: tuple[int, ...]


@dataclass(frozen=True)
class ContainerLayout:
    header: bytes
    """The 8-byte length plus the padded JSON: exactly ``data_start`` bytes."""
    offsets: tuple[int, ...]
    """Each item's offset inside the data region."""
    data_size: int
    pads: tuple[tuple[int, int], ...] = ()
    """``(offset, size)`` of each padding entry (a gap before an item) in the data region."""

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


def plan_container(
    items: Sequence[ItemSpec], metadata: dict[str, str], alignment: int = ALIGN,
    addresses: Sequence[int | None] | None = None, congruence: int = ALIGN,
) -> ContainerLayout:
    """Place items and build the safetensors header that describes them: back to back, or with
    ``addresses`` (each item's host address, None when not in host memory) by
    ``place_congruent``, every gap a padding entry (``format.pad_key``)."""
    sizes = [item.nbytes for item in items]
    if addresses is None:
        offsets, cursor = place_back_to_back(sizes)
    else:
        offsets, cursor = place_congruent(sizes, addresses, congruence)
    entries: list[tuple[str, str, Sequence[int], int]] = []
    pads: list[tuple[int, int]] = []
    end = 0
    for item, offset in zip(items, offsets):
        if is_pad_key(item.key):
            raise ValueError(f"item key {item.key!r} is reserved for padding entries")
        if offset > end:
            pads.append((end, offset - end))
            entries.append((pad_key(len(pads) - 1), "U8", (offset - end,), offset - end))
        entries.append((item.key, item.st_dtype, item.st_shape, item.nbytes))
        end = offset + item.nbytes
    header, _ = build_header(entries, metadata, alignment)  # back to back: the same offsets
    return ContainerLayout(header, tuple(offsets), cursor, tuple(pads))
