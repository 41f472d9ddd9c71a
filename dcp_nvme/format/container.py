"""A checkpoint's files (pure, no I/O): the safetensors container -- the dtype tables, the header
codec (``build_header``, ``parse_header``, padding entries), and where each item goes in the file
(``plan_container``: back to back, or congruent to its host address so that it is written
straight from memory) -- and the names of every file in a checkpoint directory, checked as
hostile input (``data_file_name``, ``check_name``, ``temp_name``)."""

from __future__ import annotations

import io
import json
import math
import re
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dcp_nvme.config import ALIGN
from dcp_nvme.errors import ManifestError

if TYPE_CHECKING:
    import torch

ST_NAMES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
}
"""torch dtypes safetensors' torch API (0.8, ``safetensors.torch._TYPES``) maps by name, fnuz
float8 included; tests/format/test_container.py holds the table to it. Any other dtype (float8 e8m0,
float4, complex32, sub-byte ints) is stored as raw U8 bytes and the index keeps the real dtype;
a container written before fnuz joined this table holds them as U8, which reading accepts."""


DTYPE_ITEMSIZE: dict[str, int] = {
    "bcomplex32": 4, "bfloat16": 2, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bool": 1,
    "complex128": 16, "complex32": 4, "complex64": 8, "float16": 2, "float32": 4,
    "float4_e2m1fn_x2": 1, "float64": 8, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "int1": 1, "int16": 2, "int2": 1, "int3": 1,
    "int32": 4, "int4": 1, "int5": 1, "int6": 1, "int64": 8, "int7": 1, "int8": 1, "qint32": 4,
    "qint8": 1, "quint2x4": 1, "quint4x2": 1, "quint8": 1, "uint1": 1, "uint16": 2, "uint2": 1,
    "uint3": 1, "uint32": 4, "uint4": 1, "uint5": 1, "uint6": 1, "uint64": 8, "uint7": 1,
    "uint8": 1,
}
"""Bytes per element of every torch dtype of the releases the suite runs on (``compat.TESTED_TORCH``),
by the name torch gives it (``torch.<name>``), so that the tools check an index without importing
torch; tests/format/test_container.py holds it to torch's own dtypes. A name torch adds later is
looked up in torch itself (``dtype_itemsize``)."""


NEWER_DTYPES: dict[str, str] = {"bcomplex32": "2.14"}
"""Dtypes of ``DTYPE_ITEMSIZE`` that torch added after the oldest release dcp_nvme runs on
(``compat.MIN_TORCH``) -> the release that added each: an older torch refuses one by name."""


DTYPE_ALIASES: dict[str, str] = {
    "bit": "uint1", "cdouble": "complex128", "cfloat": "complex64", "chalf": "complex32",
    "double": "float64", "float": "float32", "half": "float16", "int": "int32", "long": "int64",
    "short": "int16",
}
"""torch's other names of some dtypes (``torch.half is torch.float16``)."""


ST_ITEMSIZE: dict[str, int] = {st: DTYPE_ITEMSIZE[name] for name, st in ST_NAMES.items()}


def __getattr__(name: str) -> Any:
    if name == "ST_DTYPES":  # torch-keyed, for the code that already holds torch dtypes
        import torch

        return {getattr(torch, n): st for n, st in ST_NAMES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


RAW_DTYPE = "U8"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object, where: str = "the index") -> torch.dtype:
    """A torch dtype by name; never evaluates anything."""
    import torch  # here, not at import: the tools read an index without torch

    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        if name in NEWER_DTYPES:
            raise ManifestError(f"{where}: dtype {name!r} is new in torch {NEWER_DTYPES[name]} and this is torch "
                                f"{torch.__version__}: load it with torch {NEWER_DTYPES[name]} or newer")
        raise ManifestError(f"{where}: unknown dtype {name!r} (written by a newer torch?)")
    return value


def dtype_itemsize(name: object, where: str = "the index") -> int:
    """Bytes per element of the torch dtype called ``name``, without importing torch for the
    dtypes it has today; raises ManifestError for a name that is no dtype."""
    if isinstance(name, str) and DTYPE_ALIASES.get(name, name) in DTYPE_ITEMSIZE:
        return DTYPE_ITEMSIZE[DTYPE_ALIASES.get(name, name)]
    return parse_dtype(name, where).itemsize


def stored_as(dtype: torch.dtype | str, shape: Sequence[int], nbytes: int) -> tuple[str, tuple[int, ...]]:
    """The safetensors dtype and shape a tensor of ``dtype`` (a torch dtype or its name) is
    stored under in a container."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    st_dtype = ST_NAMES.get(DTYPE_ALIASES.get(name, name))
    return (st_dtype, tuple(shape)) if st_dtype else (RAW_DTYPE, (nbytes,))


PAD_PREFIX = "__pad__."
"""Keys of padding entries: bytes between items, placed so a host tensor's bytes share its memory's
alignment in the file (``place_congruent``). safetensors lets no gap go undescribed, so
each gap is a U8 entry of its own; readers of the container never show or load one. Format 4
names them ``__pad__.<rank>.<n>`` (unique in the checkpoint, so torch's HuggingFaceStorageReader,
which takes every key for a tensor, never sees two files' pads as chunks of one), earlier formats
``__pad__.<n>``. The writer refuses a state-dict name with this prefix (``save.items``)."""


SHARDING_INFO = "DCP_SHARDING_INFO"
"""The ``__metadata__`` entry where torch's HuggingFaceStorageReader finds each key's chunk
offsets (``{key: {"saved_offsets": [...]}}``, JSON; torch's ``_hf_utils.CUSTOM_METADATA_KEY``).
torch looks up every key the file lists, pads included, so each has one (format 4)."""


FQN_KEYS_VERSION = 4
"""From this format version an item's container key is its fqn (what torch's reader takes for
the tensor's name); a null key in the index means the fqn. Before, ``default_item_key``."""


def pad_key(index: int, tag: int | None = None) -> str:
    return f"{PAD_PREFIX}{index}" if tag is None else f"{PAD_PREFIX}{tag}.{index}"


_PAD_RE = re.compile(r"^__pad__\.\d+(?:\.\d+)?$")


def is_pad_key(key: str) -> bool:
    return _PAD_RE.match(key) is not None


def default_item_key(fqn: str, offsets: tuple[int, ...] | None, fqn_keys: bool = False) -> str:
    """An item's name inside its container when the index stores none (a null in its ``key``
    column: at 16k ranks the keys were half of the index's decoding time). Format 4
    (``fqn_keys``): the fqn. Before: the fqn, with the chunk's offsets after an ``@`` when any
    is non-zero (``offsets`` is None for a bytes item), the name format 4 gives a second chunk
    of one fqn in one file (``offsets_key``), stored in the index."""
    if fqn_keys or not offsets or not any(offsets):
        return fqn
    return offsets_key(fqn, offsets)


def offsets_key(fqn: str, offsets: tuple[int, ...]) -> str:
    return f"{fqn}@{','.join(str(o) for o in offsets)}"


MAX_HEADER = 100_000_000
"""Largest safetensors JSON header accepted (the cap safetensors itself applies)."""


MAX_NDIM = 64


@dataclass(frozen=True)
class HeaderItem:
    """One tensor as a safetensors header describes it; ``start``/``end`` are data-region offsets."""

    key: str
    st_dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def build_header(
    items: Sequence[tuple[str, str, Sequence[int], int]], metadata: dict[str, str] | None, alignment: int
) -> tuple[bytes, list[int]]:
    """The 8-byte length and JSON header for ``(key, st_dtype, shape, nbytes)`` items stored back
    to back, padded with spaces so the data starts on an ``alignment`` boundary; and each
    item's offset in the data region."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets: list[int] = []
    cursor = 0
    for key, st_dtype, shape, nbytes in items:
        if key in header:
            raise ValueError(f"duplicate item key {key!r} in one container")
        offsets.append(cursor)
        header[key] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % alignment)
    return struct.pack("<Q", len(text)) + text, offsets


def header_length(first8: bytes | bytearray, file_size: int, what: str) -> int:
    """The JSON length a safetensors file declares, checked against the cap and the real size."""
    if len(first8) < 8 or file_size < 8:
        raise ManifestError(f"{what}: {file_size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", first8[:8])
    if length > MAX_HEADER:
        raise ManifestError(f"{what}: the safetensors header claims {length} bytes, more than the "
                            f"{MAX_HEADER} allowed; the file is damaged or not a safetensors file")
    if 8 + length > file_size:
        raise ManifestError(f"{what}: the safetensors header claims {length} bytes but the file has "
                            f"{file_size} (truncated, or not a safetensors file)")
    return length


def parse_header(prefix: bytes | bytearray, what: str) -> tuple[dict[str, object], list[HeaderItem], int]:
    """``(metadata, items, data_start)`` from a safetensors file's first bytes (at least the header).

    Every entry is checked: a known dtype, a shape of non-negative ints, offsets that hold exactly
    shape x itemsize bytes; items may not overlap. ``ManifestError`` names the file and item.
    Padding entries (``is_pad_key``) are checked too but not returned: they hold no data.
    """
    length = header_length(prefix[:8], len(prefix), what)
    try:
        header = json.loads(bytes(prefix[8 : 8 + length]))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ManifestError(f"{what}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ManifestError(f"{what}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise ManifestError(f"{what}: the safetensors __metadata__ is not a JSON object")
    items = [_header_item(key, entry, what) for key, entry in header.items()]
    end = -1
    for item in sorted(items, key=lambda i: (i.start, i.end)):
        if item.start < end and item.nbytes:
            raise ManifestError(f"{what}: item {item.key!r} overlaps the item before it")
        end = max(end, item.end)
    return metadata, [item for item in items if not is_pad_key(item.key)], 8 + length


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _header_item(key: str, entry: object, what: str) -> HeaderItem:
    bad = f"{what}: item {key!r} has a malformed safetensors entry {str(entry)[:200]}"
    if not isinstance(entry, dict):
        raise ManifestError(bad)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (dtype not in ST_ITEMSIZE or not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(_is_count(n) for n in shape) or not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_count(n) for n in offsets) or offsets[0] > offsets[1]):
        raise ManifestError(bad)
    if math.prod(shape) * ST_ITEMSIZE[dtype] != offsets[1] - offsets[0]:
        raise ManifestError(f"{what}: item {key!r}: dtype {dtype} x shape {shape} is not the "
                            f"{offsets[1] - offsets[0]} bytes of its data_offsets")
    return HeaderItem(key, dtype, tuple(shape), offsets[0], offsets[1])


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
    offsets: tuple[int, ...] | None = None
    """Where the chunk sits in its tensor, for ``SHARDING_INFO`` (None: at the origin)."""


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
    pad_tag: int | None = None, sharding: bool = False,
) -> ContainerLayout:
    """Place items and build the safetensors header that describes them: back to back, or with
    ``addresses`` (each item's host address, None when not in host memory) by
    ``place_congruent``, every gap a padding entry (``pad_key(n, pad_tag)``). With ``sharding``
    the metadata gets ``SHARDING_INFO``: every entry's offsets, for torch's reader."""
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
            entries.append((pad_key(len(pads) - 1, pad_tag), "U8", (offset - end,), offset - end))
        entries.append((item.key, item.st_dtype, item.st_shape, item.nbytes))
        end = offset + item.nbytes
    if sharding:
        given = {item.key: item.offsets for item in items}
        info = {key: {"saved_offsets": list(given.get(key) or (0,) * len(shape))} for key, _, shape, _ in entries}
        metadata = {**metadata, SHARDING_INFO: json.dumps(info, separators=(",", ":"))}
    header, _ = build_header(entries, metadata, alignment)  # back to back: the same offsets
    return ContainerLayout(header, tuple(offsets), cursor, tuple(pads))


# File names of a checkpoint directory, checked as hostile input.

MANIFEST = "manifest.json"


DCP_METADATA = ".metadata"  # the commit marker of DCP's own FileSystemWriter


TABLE_KINDS = ("index", "blocks", "copies")
"""``copies`` is optional: the extra copies of items several directories hold (``save.copies``)."""


def tables_of(doc: dict) -> list[tuple[str, dict]]:
    """The manifest's table entries, ``(kind, entry)``, the optional ``copies`` only where present."""
    return [(kind, doc[kind]) for kind in TABLE_KINDS if kind in doc]


_KEY = r"[0-9a-f]{1,64}"


_KEY_RE = re.compile(rf"^{_KEY}$")


_DATA_RE = re.compile(rf"^rank_(\d{{5,9}})\.({_KEY})\.safetensors$")


_TABLE_RE = re.compile(rf"^(index|blocks|copies)\.({_KEY})\.parquet$")


def data_file_name(rank: int, key: str) -> str:
    return f"rank_{rank:05d}.{key}.safetensors"


def table_name(kind: str, key: str) -> str:
    if kind not in TABLE_KINDS:
        raise ValueError(f"unknown table kind {kind!r}")
    return f"{kind}.{key}.parquet"


def save_key_of(name: str) -> str | None:
    """The save key in one of our file names, or None for anything else."""
    match = _DATA_RE.match(name) or _TABLE_RE.match(name)
    return match.group(2) if match else None


def check_save_key(key: object, where: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ManifestError(f"{where}: save_key {key!r} is not a hex id; the manifest is not ours or is damaged")
    return key


def check_name(name: object, kind: str, key: str, where: str) -> str:
    """``name`` as read from a checkpoint, if it is the bare file name of a ``kind`` file of save
    ``key`` ("data", "index", "blocks" or "copies"); a ManifestError otherwise.

    The regular expressions admit only ``[a-z0-9_.]`` with no leading dot, so a name that passes
    has no separator, no ``..`` and no absolute form, and stays inside the checkpoint directory.
    """
    if not isinstance(name, str):
        raise ManifestError(f"{where}: a file name is a {type(name).__name__} ({name!r}), not a string")
    if kind == "data":
        match = _DATA_RE.match(name)
    elif kind in TABLE_KINDS:
        match = _TABLE_RE.match(name)
        match = match if match and match.group(1) == kind else None
    else:
        raise ValueError(f"unknown file kind {kind!r}")
    if match is None or match.group(2) != key:
        expected = data_file_name(0, key).replace("00000", "NNNNN") if kind == "data" else table_name(kind, key)
        raise ManifestError(f"{where}: file name {name!r} is not of the form {expected!r}; a checkpoint "
                            "names only files inside its own directory")
    return name


def rank_of(name: str) -> int:
    """The rank in a data file name that ``check_name`` accepted."""
    match = _DATA_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a data file name")
    return int(match.group(1))


FORMAT = "dcp_nvme"


FORMAT_VERSION = 4
"""2: a container's data may be preceded by ``__pad__.N`` padding entries (zero-copy placement).
3: the index's ``key`` column is null where the key is the default one (``default_item_key``).
4: stock torch's HuggingFaceStorageReader loads and reshards it: an item's key is its fqn
(``FQN_KEYS_VERSION``), every container's ``__metadata__`` has ``SHARDING_INFO``, and pads are
``__pad__.<rank>.<n>``.
A reader before a version would call such a checkpoint damaged; the bump makes it ask for an
upgrade instead. This reader loads 1 to 4 alike (padding is dropped by
``format.container.parse_header``, a null key is derived wherever a key is read, by version)."""


OLDEST_FORMAT_VERSION = 1


def new_save_key() -> str:
    return secrets.token_hex(4)


_TEMP_RE = re.compile(r"^\.(manifest\.json|(?:index|blocks)\.[0-9a-f]+\.parquet)\.tmp-([0-9A-Za-z]+)$")


def temp_name(name: str, save_key: str) -> str:
    """Where ``name`` is written before it is renamed into place; it names the save."""
    return f".{name}.tmp-{save_key}"


def temp_of(name: str) -> tuple[str, str] | None:
    """(final name, save key or legacy pid) of one of our commit temp files, else None.

    Other hidden temp files of the directory (the drain journal's) are not ours."""
    match = _TEMP_RE.match(name)
    return (match.group(1), match.group(2)) if match else None


REPLICAS_DIR = ".replicas"
"""``<checkpoint>/.replicas/<node>/``: another node's files of this save, pulled from it."""
RANGES_DIR = ".ranges"
SPANS_SUFFIX = ".spans"
"""``<checkpoint>/.ranges/<file>``: the ranges of another node's file a restore fetched for this
node's ranks, kept (``peers.kept.KeptRanges``); ``<file>.spans`` says which."""
REPLICA_MARKER = "replica.json"
"""Written last into a replica's directory: a replica without it is never used."""
REPLICATION_RECORD = ".replication.json"
"""On a node's own copy: which nodes hold a replica of its files (``peers.replicate``)."""

_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_node_name(node: object, where: str) -> str:
    """A node's name (torchrun's node rank or a host name) as read from a peer or a manifest:
    letters, digits, ``_``, ``-`` and single dots, no leading dot, no separator, so
    ``.replicas/<node>`` stays one directory inside the checkpoint."""
    if not isinstance(node, str) or not _NODE_RE.match(node) or ".." in node:
        raise ManifestError(f"{where}: node name {node!r} is not a node rank or a plain host name")
    return node


def is_served_name(name: object) -> bool:
    """Whether a peer may ask for ``name``: the manifest, a rank file or a table of any save."""
    return isinstance(name, str) and (name == MANIFEST or save_key_of(name) is not None)


# A non-tensor item is stored as DCP stores it, a ``torch.save`` archive; what its pickle imports
# decides whether NVMeReader builds it without running code (load/objects.py) or only with
# ``allow_pickle=True`` -- which the save says when it writes one (save/items.py).

BYTES_GLOBALS = frozenset({"_io.BytesIO", "builtins.bytes"})
"""What the weights-only unpickler refuses in a BytesIO or an empty ``bytes``, and
``_BytesUnpickler`` builds."""


def unsafe_globals(data: bytes) -> list[str]:
    """Names the item's pickle would import beyond the weights-only allow-list (nothing is run)."""
    import torch  # here, not at import: ``dcp-nvme verify`` of plain values runs without torch

    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception:  # noqa: BLE001 - not even a readable torch.save file: no names to give
        return []


def needs_pickle(data: bytes) -> list[str]:
    """What a stored item's pickle imports beyond what NVMeReader builds without running code
    (torch's weights-only list, plus bytes and BytesIO): empty when it loads by default."""
    return [name for name in unsafe_globals(data) if name not in BYTES_GLOBALS]
