"""Which bytes of a rank file a delta codes against which bytes of its base (pure).

A delta is taken per item: each tensor chunk against the same chunk of the base checkpoint
(same key, chunk offsets and sizes, global shape and dtype; a non-tensor item: same key and
length), found through both checkpoints' index tables wherever either container placed it.
The container layout follows the tensors' memory addresses (zero-copy placement), so a state
of fresh tensors lands at other offsets, with other pads, than its base did: matching by item
makes that cost nothing. What has no match (new, resharded, another shape or dtype) is coded
full, item by item, each with the reason.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from dcp_nvme.format.tables import ChunkRecord, FileRecord
from dcp_nvme.tiers.codec import Chunk

REPORTED = 20
"""Items coded full named per file (the rest are counted)."""


def item_key(chunk: ChunkRecord) -> tuple:
    """What must be equal for two items to be the same item of two checkpoints."""
    return (chunk.fqn, chunk.kind, chunk.offsets, chunk.sizes, chunk.global_shape, chunk.dtype, chunk.length)


def item_name(chunk: ChunkRecord) -> str:
    """An item as a person reads it: its key, and its chunk offsets when it is one of several."""
    sharded = chunk.kind == "tensor" and any(chunk.offsets)
    return f"{chunk.fqn}{list(chunk.offsets)}" if sharded else chunk.fqn


@dataclass(frozen=True)
class FullItem:
    """An item of a delta-coded file that is coded full, and why."""

    item: str
    reason: str
    length: int


@dataclass
class FileMatch:
    """How one rank file is delta-coded: against which base file, and each matched item's
    offset there (``offsets``: byte offset here -> byte offset in the base file)."""

    name: str
    base: FileRecord | None = None
    offsets: dict[int, int] = field(default_factory=dict)
    item_bytes: int = 0
    delta_bytes: int = 0
    full: list[FullItem] = field(default_factory=list)
    why: str = ""
    """Why nothing of the file is delta-coded ("" when something is)."""

    @property
    def full_bytes(self) -> int:
        return self.item_bytes - self.delta_bytes


def _changed(item: ChunkRecord, candidates: Sequence[ChunkRecord]) -> str:
    """Why ``item`` has no equal in the base, given the base's items of the same key."""
    if not candidates:
        return "new since the base"
    if all(c.kind != item.kind for c in candidates):
        return f"a {item.kind} item here, a {candidates[0].kind} item in the base"
    if item.kind == "tensor":
        shapes = {c.global_shape for c in candidates}
        if item.global_shape not in shapes:
            return f"shape {list(next(iter(shapes)))} in the base, {list(item.global_shape)} here"
        same = [c for c in candidates if (c.offsets, c.sizes) == (item.offsets, item.sizes)]
        if not same:
            return "resharded: no chunk of the base has its offsets and sizes"
        if same[0].dtype != item.dtype:
            return f"dtype {same[0].dtype} in the base, {item.dtype} here"
        return f"{same[0].length} bytes in the base, {item.length} here"
    return f"{candidates[0].length} bytes in the base, {item.length} here"


@dataclass
class BaseIndex:
    """The base checkpoint's items by what makes them the same item, and by key (built once)."""

    files: dict[str, FileRecord]
    found: dict[tuple, ChunkRecord] = field(default_factory=dict)
    by_fqn: dict[str, list[ChunkRecord]] = field(default_factory=dict)


def index_base(base_chunks: Sequence[ChunkRecord], base_files: dict[str, FileRecord]) -> BaseIndex:
    index = BaseIndex(base_files)
    for c in base_chunks:
        if c.length > 0 and c.file in base_files:
            index.found.setdefault(item_key(c), c)
            index.by_fqn.setdefault(c.fqn, []).append(c)
    return index


def match_file(record: FileRecord, chunks: Sequence[ChunkRecord], base: BaseIndex) -> FileMatch:
    """Match the items of one rank file (``chunks``: its index rows) with the base's items.

    The base file is the one holding most of the matched bytes (the same rank on a tie); the
    items matched in it are delta-coded, every other item is coded full with its reason."""
    items = [c for c in chunks if c.length > 0]
    found, by_fqn, base_files = base.found, base.by_fqn, base.files
    weight: dict[str, int] = {}
    for item in items:
        twin = found.get(item_key(item))
        if twin is not None:
            weight[twin.file] = weight.get(twin.file, 0) + item.length
    match = FileMatch(record.name, item_bytes=sum(c.length for c in items))
    if weight:
        chosen = max(weight, key=lambda n: (weight[n], base_files[n].rank == record.rank, n))
        match.base = base_files[chosen]
    for item in sorted(items, key=lambda c: c.byte_offset):
        twin = found.get(item_key(item))
        if twin is not None and match.base is not None and twin.file == match.base.name:
            match.offsets[item.byte_offset] = twin.byte_offset
            match.delta_bytes += item.length
            continue
        reason = (f"its base copy is in {twin.file}, the file's base is {match.base.name}"
                  if twin is not None and match.base is not None  # a twin means a base was chosen
                  else _changed(item, by_fqn.get(item.fqn, [])))
        match.full.append(FullItem(item_name(item), reason, item.length))
    if match.base is None:
        match.why = ("no item of it is in the base unchanged" if items else "it holds no items")
    return match


def assign_bases(chunks: Sequence[Chunk], spans: Sequence[tuple[int, int]], offsets: dict[int, int]) -> list[Chunk]:
    """``chunks`` (cut on item boundaries) with the base offset of each one inside a matched
    item (``spans``: each item's (offset, length) here; ``offsets``: matched items' base offsets)."""
    ordered = sorted((o, n) for o, n in spans if o in offsets)
    starts = [o for o, _ in ordered]
    out = []
    for chunk in chunks:
        at = bisect.bisect_right(starts, chunk.offset) - 1
        if at >= 0:
            start, length = ordered[at]
            if chunk.offset + chunk.length <= start + length:
                chunk = replace(chunk, base=offsets[start] + chunk.offset - start)
        out.append(chunk)
    return out


def summarize(matches: Sequence[FileMatch], against: str) -> dict:
    """The drain result's ``delta`` section: how much is delta-coded, and what is not and why."""
    items = sum(m.item_bytes for m in matches)
    delta = sum(m.delta_bytes for m in matches)
    full = [{"file": m.name, "item": f.item, "reason": f.reason, "bytes": f.length}
            for m in matches for f in m.full[:REPORTED]]
    return {"against": against, "item_bytes": items, "delta_bytes": delta,
            "fraction": round(delta / items, 4) if items else 1.0,
            "full_items": sum(len(m.full) for m in matches), "full": full,
            "files_full": {m.name: m.why for m in matches if m.why and m.item_bytes}}


def describe(summary: dict) -> str:
    """One line for people: how much of the checkpoint is delta-coded, and the first reasons."""
    line = (f"{summary['fraction'] * 100:.1f}% of the items' bytes delta-coded against {summary['against']}")
    if summary["full_items"]:
        shown = "; ".join(f"{f['item']} ({f['reason']})" for f in summary["full"][:3])
        more = summary["full_items"] - min(3, len(summary["full"]))
        line += f"; {summary['full_items']} item(s) coded full: {shown}" + (f" and {more} more" if more > 0 else "")
    return line
