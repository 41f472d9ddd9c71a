"""The manifest: ``manifest.json``, the commit marker naming the two tables.

    manifest.json          format version, world size, DCP planner data, config, timings, and
                           the name, size and crc32c of the two tables. Written last: the
                           checkpoint exists once this file does.

``<key>`` is a random id per save, so an overwrite never touches the files of the checkpoint it
replaces until its own manifest is committed. Nothing here is pickled: planner data goes
through a JSON codec of its own (``encode_json``/``decode_json``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dcp_nvme.errors import (
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    ManifestError,
    TableError,
)
from dcp_nvme.format.checksums import check_table
from dcp_nvme.format.column_checks import check_columns
from dcp_nvme.format.columns import ChunkColumns
from dcp_nvme.format.container import (
    DCP_METADATA,
    FORMAT,
    FORMAT_VERSION,
    FQN_KEYS_VERSION,
    MANIFEST,
    OLDEST_FORMAT_VERSION,
    parse_dtype,
    save_key_of,
)
from dcp_nvme.format.tables import (
    CODED,
    FREE_ROWS,
    MIN_CHECKSUM_BLOCK,
    MIN_ITEM_HEADER,
    ChunkRecord,
    FileRecord,
    column_values,
    gc_paused,
    parquet_footer,
    parse_chunks,
    parse_files,
    read_chunk_table,
)
from dcp_nvme.format.validation import check_doc, check_files, check_row

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from dcp_nvme.format.metadata_view import StorageView

MAX_MANIFEST = 256 << 20
"""Largest manifest.json accepted (planner data included)."""


def encode_json(value: Any, where: str = "planner_data") -> Any:
    """JSON with tuples kept as tuples; anything JSON cannot carry is an error, never a pickle."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode_json(v, where) for v in value]}
    if isinstance(value, list):
        return [encode_json(v, where) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is a {type(k).__name__}, not a string")
            if k == "__tuple__":
                raise ValueError(f"{where}: the key '__tuple__' is reserved")
            out[k] = encode_json(v, f"{where}[{k!r}]")
        return out
    raise ValueError(
        f"{where} holds a {type(value).__module__}.{type(value).__name__}, which dcp_nvme cannot "
        "store without pickling; use a planner whose planner_data is JSON-like "
        "(dict/list/tuple/str/int/float/bool/None)"
    )


def decode_json(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(decode_json(v) for v in value["__tuple__"])
        return {k: decode_json(v) for k, v in value.items()}
    return value


class Manifest:
    """A committed checkpoint as read back: the JSON document and the chunk index, held as
    columns (``columns``) when read from disk; ``chunks`` makes every row a ChunkRecord on
    first use, which a load does not need (``to_metadata``, ``rows_of_file``)."""

    def __init__(self, doc: dict[str, Any], chunks: list[ChunkRecord] | None = None,
                 columns: ChunkColumns | None = None) -> None:
        self.doc = doc
        self.columns = columns
        self._chunks = chunks
        self._files: dict[str, FileRecord] | None = None
        self._declared_bytes: int | None = None
        self._by_file: dict[str, list[ChunkRecord]] | None = None
        self._file_rows: dict[str, Any] | None = None
        self.copies: list[ChunkRecord] = []
        """Rows of the copies table: items a node-local save wrote once per node (``save.copies``)."""

    def __repr__(self) -> str:
        return f"Manifest(save_key={self.doc.get('save_key')!r}, rows={self.row_count})"

    @property
    def chunks(self) -> list[ChunkRecord]:
        if self._chunks is None:
            self._chunks = self.columns.records() if self.columns is not None else []
        return self._chunks

    @chunks.setter
    def chunks(self, value: list[ChunkRecord]) -> None:
        self._chunks, self.columns, self._by_file, self._file_rows = value, None, None, None

    @property
    def row_count(self) -> int:
        return len(self.columns) if self.columns is not None else len(self.chunks)

    def rows_by_file(self) -> dict[str, list[ChunkRecord]]:
        """The rows of each container file: its index rows, then its copies."""
        if self._by_file is None:
            self._by_file = {}
            for chunk in [*self.chunks, *self.copies]:
                self._by_file.setdefault(chunk.file, []).append(chunk)
        return self._by_file

    def rows_of_file(self, name: str) -> list[ChunkRecord]:
        """The rows of one container file, its index rows then its copies (only they become
        ChunkRecords): every item its safetensors header holds."""
        if self.columns is None or self._chunks is not None:
            return self.rows_by_file().get(name, [])
        if self._file_rows is None:
            self._file_rows = self.columns.by_file()
        rows = self._file_rows.get(name)
        copies = [c for c in self.copies if c.file == name]
        return ([] if rows is None else self.columns.records(rows)) + copies

    def rows_before(self, data_start: dict[str, int]) -> list[ChunkRecord]:
        """The rows that start before their file's data region (``data_start`` by file name)."""
        if self.columns is None or self._chunks is not None:
            return [c for c in self.chunks if c.byte_offset < data_start[c.file]]
        cols = self.columns
        starts = np.array([data_start.get(name, 0) for name in cols.files], dtype=np.int64)
        return cols.records(np.flatnonzero(cols.byte_offset < starts[cols.file]) if len(cols) else [])

    @property
    def save_key(self) -> str:
        return self.doc["save_key"]

    @property
    def created_unix(self) -> float | None:
        """When the save's commit was written (its writer's wall clock), if recorded as a
        finite positive number: what tells two saves of one step apart."""
        value = self.doc.get("created_unix")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            return None
        return float(value)

    @property
    def compression(self) -> Any:
        """The ``compression`` section the drain wrote into a compressed mirror's manifest (its
        codec and stored files, checked by ``tiers.coded.coded_files`` before use); None for a
        plain checkpoint. How a checkpoint is read is decided by this field alone, never by what
        else the manifest's text holds (a state dict key may be any word)."""
        return self.doc.get("compression")

    @property
    def file_names(self) -> list[str]:
        return [f["name"] for f in self.doc["files"]]

    @property
    def node_local(self) -> bool:
        """Whether each node's disk holds only its own ranks' files (and all the metadata)."""
        return (self.doc.get("topology") or {}).get("mode") == "node-local"

    def node_of(self, rank: int) -> str | None:
        """The node that wrote ``rank``'s file (checked by ``check_topology``), if recorded."""
        topology = self.doc.get("topology")
        if topology is None or not 0 <= rank < len(topology["rank_nodes"]):
            return None
        return topology["nodes"][topology["rank_nodes"][rank]]

    def files_by_node(self) -> dict[str, list[str]]:
        """Data file names per node that wrote them (one entry ``""`` when not recorded)."""
        out: dict[str, list[str]] = {}
        for entry in self.doc["files"]:
            out.setdefault(self.node_of(entry["rank"]) or "", []).append(entry["name"])
        return out

    def missing_file_error(self, name: str, rank: int, location: str) -> CheckpointNotFoundError:
        """A data file the manifest lists is not in this directory: where it is, what to do."""
        node = self.node_of(rank)
        if self.node_local and node is not None:
            return CheckpointNotFoundError(
                f"{location}: this load needs {name} (rank {rank}'s data), which node {node} wrote to "
                "its own disk: this directory is node-local and holds only its node's ranks. Load "
                "on the nodes that saved it with the ranks reading what they saved, or from the "
                "checkpoint's mirror (NVMeWriter(mirror=...), dcp-nvme drain)")
        return CheckpointNotFoundError(f"{location}: {name} (rank {rank}'s data) named by {MANIFEST} "
                                       "is missing: the checkpoint is damaged")

    def to_metadata(self) -> Metadata:
        """DCP's Metadata, rebuilt from data: over the columns, a lazy one (``metadata_view``)."""
        storage: StorageView | dict[MetadataIndex, ChunkRecord]
        if self.columns is not None and self._chunks is None:
            state, storage = metadata_over(self.columns)
        else:
            state, storage = _eager_metadata(self.chunks)
        # torch here, not at import: the tools read a manifest without torch
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        meta = self.doc.get("storage_meta") or {}
        return Metadata(
            state_dict_metadata=state,
            planner_data=decode_json(self.doc.get("planner_data")),
            storage_data=storage,
            storage_meta=StorageMeta(
                checkpoint_id=meta.get("checkpoint_id"), save_id=meta.get("save_id"),
                modules=[m for m in _list_or_empty(meta.get("modules")) if isinstance(m, str)],
            ),
            version=self.doc.get("dcp_version"),
        )


def _eager_metadata(chunks: list[ChunkRecord]) -> tuple[dict[str, Any], dict[MetadataIndex, ChunkRecord]]:
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, ChunkRecord] = {}
    for chunk in chunks:
        if chunk.kind == "bytes":
            state[chunk.fqn] = BytesStorageMetadata()
        else:
            entry = state.get(chunk.fqn)
            if entry is None:
                entry = state[chunk.fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=parse_dtype(chunk.dtype, f"{MANIFEST}: tensor {chunk.fqn!r}")),
                    torch.Size(chunk.global_shape),
                    [],
                )
            entry.chunks.append(
                ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes))
            )
        storage[chunk.index] = chunk
    return state, storage


def metadata_over(cols: ChunkColumns) -> tuple[dict[str, Any], StorageView]:
    """``state_dict_metadata`` and ``storage_data`` over checked columns: one entry per tensor,
    in the order of the tensors' first rows; no object per row."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties

    from dcp_nvme.format.metadata_view import IndexedTensorMetadata, StorageView, TensorSweeps

    state: dict[str, Any] = {}
    bytes_rows: dict[str, int] = {}
    if len(cols):
        order, first, counts = cols.groups(cols.fqn)
        firsts = order[first]
        sweeps = TensorSweeps(cols, order, first, counts)  # found on the first tensor's index
        with gc_paused():
            for g in np.argsort(firsts, kind="stable").tolist():
                row = int(firsts[g])
                fqn = cols.fqns[cols.fqn[row]]
                if cols.kinds[cols.kind[row]] == "bytes":
                    state[fqn] = BytesStorageMetadata()
                    bytes_rows[fqn] = int(order[first[g] + counts[g] - 1])
                else:
                    rows = order[first[g]:first[g] + counts[g]]
                    state[fqn] = IndexedTensorMetadata(
                        TensorProperties(dtype=parse_dtype(cols.dtypes[cols.dtype[row]], f"{MANIFEST}: tensor {fqn!r}")),
                        torch.Size(cols.list_of(2, row)), cols, rows, sweeps, g)
    return state, StorageView(cols, state, bytes_rows)


def _list_or_empty(value: Any) -> list:
    return value if isinstance(value, list) else []


def table_entry(name: str, data: bytes) -> dict[str, Any]:
    rows = pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows
    return {"name": name, "size": len(data), "crc32c": crc32c.crc32c(data), "rows": rows}


def build_manifest_doc(
    *,
    save_key: str,
    files: Iterable[FileRecord],
    index: dict[str, Any],
    blocks: dict[str, Any],
    world_size: int,
    planner_data: Any,
    dcp_version: str | None,
    storage_meta: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    files = list(files)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "save_key": save_key,
        "world_size": world_size,
        "dcp_version": dcp_version,
        "planner_data": encode_json(planner_data),
        "storage_meta": storage_meta,
        "index": index,
        "blocks": blocks,
        "files": [{"name": f.name, "rank": f.rank, "size": f.size} for f in files],
        "total_bytes": sum(f.size for f in files),
        **extra,
    }


def missing_manifest_error(store, location: str) -> CheckpointNotFoundError:
    """Why a directory without a committed manifest cannot be loaded: not committed (our files
    without a manifest), or not ours at all."""
    names = store.names()
    if DCP_METADATA in names:
        return CheckpointNotFoundError(
            f"{location} is a stock DCP checkpoint (FileSystemWriter's .metadata), not a dcp_nvme one; "
            "load it with NVMeReader(path, allow_pickle=True) (its .metadata is a pickle) or torch's "
            f"FileSystemReader, or convert it: dcp-nvme convert {location} OUT --to nvme")
    ours = [n for n in names if save_key_of(n)]
    if ours:
        return CheckpointNotCommittedError(
            f"{location} has {len(ours)} dcp_nvme data file(s) but no committed {MANIFEST}: "
            "the save did not finish (it crashed or is still running), so it cannot be loaded")
    return CheckpointNotFoundError(
        f"{location} is not a dcp_nvme checkpoint (no {MANIFEST}), nor a stock DCP checkpoint (.metadata), "
        "a Hugging Face model directory (*.safetensors) or a single safetensors file")


SELF_CRC = "manifest_crc32c"


def _canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != SELF_CRC}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(doc: dict[str, Any]) -> bytes:
    """The manifest's bytes, carrying a crc32c of its own canonical form (any edit is caught)."""
    return json.dumps({**doc, SELF_CRC: crc32c.crc32c(_canonical(doc))}, indent=1).encode()


def read_manifest(store, location: str, share: Callable | None = None) -> Manifest:
    """Read and validate a committed checkpoint's manifest and chunk index.

    Every name and number is checked here before anything is opened or allocated from it:
    ``check_doc`` for the manifest, the Parquet footer for the index's size, ``check_chunks``
    for each row (see the "Trust model" section of docs/design.md). ``share(doc, rows, build)``
    may give the checked columns instead of ``build()`` (the ranks of a node share one decode:
    ``load.node_index``)."""
    manifest = read_manifest_doc(store, location)
    doc = manifest.doc
    entry = doc["index"]

    def build() -> ChunkColumns:
        return _read_index(store, manifest, location)

    declared = entry.get("rows", 0)
    manifest.columns = build() if share is None else share(doc, declared, build)
    manifest.copies = read_copies(store, manifest, location)
    return manifest


def read_manifest_doc(store, location: str) -> Manifest:
    """``manifest.json`` alone, read and checked (``check_doc``, its own crc32c), without its
    tables: what the files are, for a look that must stay cheap (``storage.intact``)."""
    if not store.exists():
        raise CheckpointNotFoundError(f"checkpoint directory {location} does not exist")
    try:
        store.size(MANIFEST)  # a FIFO, device or link under this name is refused, never opened
    except FileNotFoundError:
        raise missing_manifest_error(store, location) from None
    try:
        doc = json.loads(store.read(MANIFEST, MAX_MANIFEST))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"{location}/{MANIFEST} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"{location}/{MANIFEST} is not a dcp_nvme manifest")
    version = doc.get("format_version")
    if type(version) is not int or version < OLDEST_FORMAT_VERSION:
        raise ManifestError(f"{location}/{MANIFEST} has format version {version!r}, not a version "
                            f"number from {OLDEST_FORMAT_VERSION}: the manifest is damaged")
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{location} uses format version {version!r}; this dcp_nvme reads up to "
            f"{FORMAT_VERSION}: upgrade dcp_nvme"
        )
    if doc.get(SELF_CRC) != crc32c.crc32c(_canonical(doc)):
        raise ManifestError(f"{location}/{MANIFEST} fails its own checksum: the manifest is corrupt "
                            "or was edited after the save")
    check_doc(doc, f"{location}/{MANIFEST}")
    return Manifest(doc)


def fqn_keys(doc: dict[str, Any]) -> bool:
    """Whether a null key in the checkpoint's index is the fqn (format 4 on)."""
    return doc.get("format_version", 0) >= FQN_KEYS_VERSION


def _read_index(store, manifest: Manifest, location: str) -> ChunkColumns:
    """The index table read, decoded into columns and checked."""
    data, what, parquet = _counted_table(store, manifest.doc["index"], location, CODED)
    limit = _row_limit(store, manifest, parquet.metadata.num_rows, MIN_ITEM_HEADER)
    table = read_chunk_table(data, what, limit, parquet)
    columns = ChunkColumns.from_table(table, fqn_keys=fqn_keys(manifest.doc))
    del table, data, parquet
    check_columns(columns, manifest.doc, what)
    return columns


def _counted_table(store, entry: dict[str, Any], location: str,
                   dictionary: tuple = ()) -> tuple[bytes, str, pq.ParquetFile]:
    """A table's bytes (checked against its manifest entry), its name for errors, its footer
    parsed once (``dictionary``: see ``parquet_footer``), whose row count must be the one the
    manifest says."""
    what = f"{location}/{entry['name']}"
    data = _load_table(store, entry, location)
    parquet = parquet_footer(data, what, dictionary)
    rows = parquet.metadata.num_rows
    if "rows" in entry and rows != entry["rows"]:
        raise ManifestError(f"{what} has {rows} rows, {MANIFEST} says {entry['rows']}")
    return data, what, parquet


def read_copies(store, manifest: Manifest, location: str) -> list[ChunkRecord]:
    """The copies table (items a node-local save wrote once per node, ``save.copies``), read and
    each row checked on its own and against its file's declared size; [] when there is none.
    Whether each copy is the chunk it claims to be (same item, dtype, shape and length as the
    index's row) is checked where it replaces that row (``load.reader``)."""
    entry = manifest.doc.get("copies")
    if entry is None:
        return []
    data, what, parquet = _counted_table(store, entry, location)
    limit = _row_limit(store, manifest, parquet.metadata.num_rows, MIN_ITEM_HEADER)
    copies = parse_chunks(data, what, limit, fqn_keys(manifest.doc), parquet)
    sizes = {f["name"]: f["size"] for f in manifest.doc["files"]}
    for copy in copies:
        check_row(copy, sizes, manifest.save_key, what)
    return copies


def read_files(store, manifest: Manifest, location: str) -> dict[str, FileRecord]:
    """The per-file checksum table, read and checked once on first use."""
    if manifest._files is None:
        doc = manifest.doc
        entry = doc["blocks"]
        what = f"{location}/{entry['name']}"
        data = _load_table(store, entry, location)
        count = len(doc["files"])
        parquet = parquet_footer(data, what)  # once: the bounds and the read share it
        crcs = column_values(parquet.metadata, "crcs")
        limit = _row_limit(store, manifest, crcs, MIN_CHECKSUM_BLOCK, 64) + count
        files = parse_files(data, what, count, limit, parquet)
        check_files(files, manifest, what)
        manifest._files = files
    return manifest._files


def _row_limit(store, manifest: Manifest, wanted: int, bytes_each: int, free_factor: int = 1) -> int:
    """How many rows (or values) of ``bytes_each`` bytes the data files can account for.

    Up to ``FREE_ROWS * free_factor`` need no look; beyond, the bound is the data files' sizes
    as the manifest declares them (each checked by ``check_doc``), summed once: no file is
    stat-ed, so the cost does not grow with the world size on every rank."""
    free = FREE_ROWS * free_factor
    if wanted <= free:
        return free
    if manifest._declared_bytes is None:
        manifest._declared_bytes = sum(entry["size"] for entry in manifest.doc["files"])
    return max(free, manifest._declared_bytes // bytes_each)


def _load_table(store, entry: dict[str, Any], location: str) -> bytes:
    """A table's bytes: a regular file of the size the manifest records (checked before it is
    read, so a claim cannot make us allocate), then its crc32c."""
    name = entry["name"]
    try:
        size = store.size(name)
    except FileNotFoundError:
        raise TableError(name, f"{location}: {name} named by {MANIFEST} is missing") from None
    if size != entry["size"]:
        raise TableError(name, f"{location}: {name} does not match {MANIFEST} (size {size} vs "
                               f"{entry['size']}): the table is corrupt or was modified after the save")
    data = store.read(name, entry["size"])
    check_table(location, entry, data)
    return data


def describe_topology(topology: dict | None, elsewhere: list[str]) -> str | None:
    """``node-local on 2 nodes (node 0: ranks 0-1; node 1: ranks 2-3); node 0's files are on
    its own disk`` (pure); None for a checkpoint that did not record where it was written."""
    if not topology:
        return None
    ranks: dict[int, list[int]] = {}
    for rank, node in enumerate(topology["rank_nodes"]):
        ranks.setdefault(node, []).append(rank)
    parts = [f"node {topology['nodes'][i]}: ranks {_spans(r)}" for i, r in sorted(ranks.items())]
    text = f"{topology['mode']} on {len(topology['nodes'])} node(s) ({'; '.join(parts)})"
    if elsewhere:
        text += f"; the files of node(s) {', '.join(elsewhere)} are on their own disks, not here"
    return text


def _spans(ranks: list[int]) -> str:
    out: list[str] = []
    start: int | None = ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(out)
