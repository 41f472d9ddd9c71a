"""The base a delta drain codes against: which checkpoint (``pick_base``), which of its bytes
each item is coded against (``Base.match``, over ``delta_match``), reading those bytes checked
(``base_bytes``), and saying what was coded full and why (``note``).
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dcp_nvme.format.manifest import Manifest
from dcp_nvme.format.pieces import Piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.tiers import codec
from dcp_nvme.tiers.delta_match import BaseIndex, FileMatch, describe, index_base, match_file, summarize
from dcp_nvme.tiers.source import DrainSource
from dcp_nvme.tiers.transfer import DrainFault

log = logging.getLogger(__name__)

NO_BASE = "no earlier mirrored checkpoint in the run directory: coding full"
CHAIN_FULL = "deltas since the last full checkpoint: coding full"
"""The two reasons a delta drain codes full by design (the start of a chain): said at INFO."""


@dataclass
class Base:
    """An earlier checkpoint of the same run a delta is coded against: its local copy (read,
    checked) and the mirror it is committed on (where a reader finds it)."""

    source: DrainSource
    target: str
    depth: int
    """Deltas between the base and its nearest full checkpoint (0: the base is full)."""
    _index: BaseIndex | None = field(default=None, repr=False)

    def match(self, record: FileRecord, manifest: Manifest) -> FileMatch:
        """Each item of ``record``'s rank file matched with the same item of the base, wherever
        either container placed it; the rest coded full, each with the reason."""
        if self._index is None:  # once per drain: every file is matched against the same index
            base = self.source.manifest
            self._index = index_base(base.chunks, {n: self.source.files[n] for n in base.file_names
                                                   if n in self.source.files})
        return match_file(record, [c for c in manifest.chunks if c.file == record.name], self._index)


def pick_base(location: str, target: str, every: int, mirror_manifest: Any) -> tuple[Base | None, str]:
    """The newest older checkpoint of the run directory that is mirrored (and still local), or
    None (code full) with the reason. A chain reaching ``every`` - 1 deltas starts over full.
    ``mirror_manifest(url)`` returns the parsed manifest committed at a mirror URL, or None."""
    from dcp_nvme.storage.run_dir import checkpoints
    from dcp_nvme.tiers.journal import MIRRORED, drain_state

    here = os.path.realpath(location)
    older = []
    for entry in checkpoints(os.path.dirname(here), kinds=("nvme",)):
        if os.path.realpath(entry.path) == here:
            break
        older.append(entry)
    for entry in reversed(older):
        state = drain_state(entry.path)
        if state.state != MIRRORED or not state.target or state.target == target:
            continue
        doc = mirror_manifest(state.target)
        if not isinstance(doc, dict):
            return None, f"the mirror of {entry.path} ({state.target}) is unreadable: coding full"
        compression = doc.get("compression")
        section = compression if isinstance(compression, dict) else {}
        delta = section.get("delta") if isinstance(section.get("delta"), dict) else None
        depth = int(delta.get("depth", 0)) if delta else 0
        if depth + 1 >= every:
            return None, f"{every - 1} {CHAIN_FULL}"
        try:
            source = DrainSource(str(entry.path))
        except Exception as exc:  # noqa: BLE001
            return None, f"base {entry.path} unreadable ({exc}): coding full"
        if source.manifest.save_key != doc.get("save_key"):
            return None, f"{entry.path} no longer holds the save mirrored at {state.target}: coding full"
        return Base(source, state.target, depth), f"delta against {entry.path} ({state.target})"
    return None, NO_BASE


def base_bytes(source: DrainSource, record: FileRecord,
               chunks: Sequence[codec.Chunk]) -> list[memoryview | None]:
    """The base bytes of each delta chunk (None for one coded full), read from the base's local
    copy in whole checksum blocks, each checked against its blocks table; ranges a block or
    less apart are read together (few reads, at most two blocks more per range)."""
    block, start = record.checksum_block, record.data_start
    spans: list[list[int]] = []
    for lo, hi in sorted((c.base, c.base + c.length) for c in chunks if c.base is not None):
        if lo < start or hi > record.size:
            raise DrainFault(f"{source.location}/{record.name}: base bytes {lo}-{hi} lie outside its "
                             f"data region ({start}-{record.size})")
        lo = start + (lo - start) // block * block
        hi = min(record.size, start + -(-(hi - start) // block) * block)
        if spans and lo <= spans[-1][1] + block:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    read = [(lo, memoryview(source.piece(record, Piece(0, lo, hi - lo)))) for lo, hi in spans]
    starts = [lo for lo, _ in read]
    out: list[memoryview | None] = []
    for chunk in chunks:
        if chunk.base is None:
            out.append(None)
            continue
        lo, view = read[bisect.bisect_right(starts, chunk.base) - 1]
        out.append(view[chunk.base - lo: chunk.base - lo + chunk.length])
    return out


def note(location: str, base: Base | None, why: str, matches: Sequence[FileMatch]) -> dict[str, Any]:
    """The ``delta`` section of a drain asked for ``compress="delta"``, logged: how much is
    delta-coded against what, and each file or item coded full with the reason."""
    if base is None:
        planned = why == NO_BASE or why.endswith(CHAIN_FULL)
        log.log(logging.INFO if planned else logging.WARNING,
                "dcp_nvme: compress=delta for %s: everything coded full: %s", location, why)
        return {"against": None, "fraction": 0.0, "delta_bytes": 0, "why": why}
    summary = summarize(matches, base.target)
    for name, reason in summary["files_full"].items():
        log.warning("dcp_nvme: compress=delta for %s: %s coded full: %s", location, name, reason)
    level = logging.WARNING if summary["full_items"] else logging.INFO
    log.log(level, "dcp_nvme: compress=delta for %s: %s", location, describe(summary))
    return summary


def delta_line(delta: dict[str, Any]) -> str:
    """The drain result's ``delta`` section for people."""
    if not delta.get("against"):
        return f"everything coded full: {delta.get('why', '')}"
    return describe(delta)


def status_line(delta: Any) -> str:
    """What ``status`` prints of a drain's ``delta`` summary (journal), or ""."""
    if not isinstance(delta, dict) or not isinstance(delta.get("fraction"), (int, float)):
        return ""
    if not delta.get("against"):
        return f", coded full: {delta.get('why', '')}"
    full = delta.get("full_items") or 0
    return (f", {delta['fraction'] * 100:.1f}% delta-coded against {delta['against']}"
            + (f" ({full} item(s) coded full)" if full else ""))


def journal_summary(delta: Any) -> dict[str, Any] | None:
    """What the journal keeps of the ``delta`` section (status prints it): no item list."""
    if not isinstance(delta, dict):
        return None
    return {k: delta[k] for k in ("against", "fraction", "delta_bytes", "item_bytes", "full_items", "why")
            if k in delta}
