"""The save a drain copies: read once when the drain starts, it is what the target receives.

A checkpoint directory can be overwritten (a new save committed) while it drains. The drain
holds on to the manifest and tables it read at the start, reads data only through file names
that carry that save's key, checks every piece against that save's blocks table, and asks
``changed()`` before it commits, so a mirror never mixes two saves.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dcp_nvme.errors import ManifestError
from dcp_nvme.format.checksums import check_table
from dcp_nvme.format.container import MANIFEST, tables_of
from dcp_nvme.format.manifest import Manifest, read_files, read_manifest
from dcp_nvme.format.pieces import Piece, verify_piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.host.files import open_regular
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.tiers.transfer import DrainFault, LocalDamage, SourceChanged, step


class DrainSource:
    """The save being drained, read once: its manifest and tables are what the target gets."""

    def __init__(self, location: str) -> None:
        self.location = location
        self.store = LocalStore(location)
        self.manifest_bytes = self.store.read(MANIFEST) if self.store.has(MANIFEST) else b""
        self.manifest: Manifest = read_manifest(self.store, location)
        if self.manifest_bytes != self.store.read(MANIFEST):  # a commit landed between the reads
            raise DrainFault(f"{location} was committed again while the drain started")  # retried
        self.files: dict[str, FileRecord] = read_files(self.store, self.manifest, location)
        self.tables = [(entry["name"], self._table(entry)) for _, entry in tables_of(self.manifest.doc)]
        self.nodes_here, self.names = self._held_here()
        """The nodes whose files this directory holds, and the data files this drain sends: all
        of them, except of a node-local checkpoint (each node drains its own)."""

    def _held_here(self) -> tuple[list[str], list[str]]:
        if not self.manifest.node_local:
            return [], self.manifest.file_names
        by_node = self.manifest.files_by_node()
        here = [node for node, names in by_node.items() if all(self.store.has(n) for n in names)]
        if not here:
            raise ManifestError(f"{self.location} is a node-local checkpoint whose directory holds "
                                "the complete files of no node: nothing here can be drained")
        return here, [name for node in here for name in by_node[node]]

    def check_present(self) -> None:
        """Every file this drain sends is here at its recorded size (a stat each): a missing or
        cut file fails the drain at once, before anything is sent, instead of retry after retry."""
        for name in self.names:
            record, path = self.files.get(name), self.store.path(name)
            try:
                size = self.store.size(name)
            except FileNotFoundError:
                raise LocalDamage(f"{path} is missing: the local checkpoint is damaged; a retry cannot "
                                  "restore it (save again, or load an earlier checkpoint)") from None
            if record is not None and size != record.size:
                raise LocalDamage(f"{path} is {size} bytes, its manifest says {record.size}: the local "
                                  "checkpoint is damaged; a retry cannot restore it")

    @property
    def node_local(self) -> bool:
        return self.manifest.node_local

    @property
    def save_key(self) -> str:
        return self.manifest.save_key

    def _table(self, entry: dict[str, Any]) -> bytes:
        data = self.store.read(entry["name"])
        check_table(self.location, entry, data)  # never drain a corrupt checkpoint
        return data

    def record(self, name: str) -> FileRecord | None:
        return self.files.get(name)

    def piece(self, record: FileRecord, piece: Piece) -> bytes:
        """The piece's bytes from local disk, checked against the blocks table."""
        data = self._read(record, piece, None)
        assert isinstance(data, bytes)
        return data

    def piece_into(self, record: FileRecord, piece: Piece, into: bytearray) -> bytearray:
        """``piece`` read into a buffer of its length (a sink's, reused: no fresh pages per piece)."""
        self._read(record, piece, into)
        return into

    def _read(self, record: FileRecord, piece: Piece, into: bytearray | None) -> bytes | bytearray:
        path = self.store.path(record.name)
        with step(f"reading {path} bytes {piece.offset}-{piece.offset + piece.length}"):
            try:
                handle = os.fdopen(open_regular(path), "rb")  # no FIFO, no link
            except FileNotFoundError:  # removed since the start (changed() tells an overwrite apart)
                raise LocalDamage(f"{path} is missing: the local checkpoint is damaged") from None
            with handle:
                if into is None:
                    data: bytes | bytearray = os.pread(handle.fileno(), piece.length, piece.offset)
                    got = len(data)
                else:
                    data, got = into, os.preadv(handle.fileno(), [into], piece.offset)
            if got != piece.length:
                raise ManifestError(f"{path} is truncated at {piece.offset + got} of "
                                    f"{record.size} bytes")
            verify_piece(record, piece.offset, memoryview(data), path)  # what we send is right
        return data

    def changed(self) -> str | None:
        """Why the local checkpoint is no longer the save being drained, or None."""
        try:
            current = self.store.read(MANIFEST)
        except FileNotFoundError:
            return f"{self.location}/{MANIFEST} is gone"
        except OSError:
            return None  # cannot tell; the error being handled says what went wrong
        if current == self.manifest_bytes:
            return None
        try:
            key = json.loads(current).get("save_key")
        except (ValueError, AttributeError):
            key = "?"
        return f"save {self.save_key} was replaced by save {key}"


def overwritten(location: str, why: str) -> SourceChanged:
    return SourceChanged(f"{location} was overwritten during the drain ({why}); nothing of it was "
                         "committed on the target; drain again to mirror the new save")
