"""File names of a checkpoint directory, checked as hostile input."""

from __future__ import annotations

import re
import secrets

from dcp_nvme.errors import (
    ManifestError,
)

MANIFEST = "manifest.json"


DCP_METADATA = ".metadata"  # the commit marker of DCP's own FileSystemWriter


TABLE_KINDS = ("index", "blocks")


_KEY = r"[0-9a-f]{1,64}"


_KEY_RE = re.compile(rf"^{_KEY}$")


_DATA_RE = re.compile(rf"^rank_(\d{{5,9}})\.({_KEY})\.safetensors$")


_TABLE_RE = re.compile(rf"^(index|blocks)\.({_KEY})\.parquet$")


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
    ``key`` ("data", "index" or "blocks"); a ManifestError otherwise.

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


FORMAT_VERSION = 3
"""2: a container's data may be preceded by ``__pad__.N`` padding entries (zero-copy placement).
3: the index's ``key`` column is null where the key is the default one (``default_item_key``).
A reader before a version would call such a checkpoint damaged; the bump makes it ask for an
upgrade instead. This reader loads 1, 2 and 3 alike (padding is dropped by
``format.container.parse_header``, a null key is derived wherever a key is read)."""


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
