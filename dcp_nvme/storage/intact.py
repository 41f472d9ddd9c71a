"""Whether a committed dcp_nvme checkpoint can load, from its small files: ``manifest.json`` and
its tables read and checked (sizes, crc32c, every index row), and every data file it lists
present at its size (a stat each, no data read). One check for all that judge a step:
``dcp-nvme list`` and ``status`` call a checkpoint that fails it corrupt or damaged, and
``dcp_nvme.latest`` passes over it. A changed data byte is found by the load (or ``dcp-nvme
verify``), which reads the data."""

from __future__ import annotations

import os

from dcp_nvme import seams
from dcp_nvme.errors import DCPNVMeError
from dcp_nvme.format.container import MANIFEST, tables_of
from dcp_nvme.format.manifest import Manifest, read_files, read_manifest, read_manifest_doc
from dcp_nvme.storage.local_dir import LocalStore, Store


def checked(source: Store, location: str) -> tuple[Manifest, list[str], list[str]]:
    """The checkpoint's manifest read with all its tables (``read_manifest``, ``read_files``:
    they raise for a damaged manifest or table), and :func:`quick_check`'s problems and nodes
    elsewhere."""
    manifest = read_manifest(source, location)
    read_files(source, manifest, location)
    problems, elsewhere = quick_check(source, manifest)
    return manifest, problems, elsewhere


def load_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the committed dcp_nvme checkpoint at ``path`` cannot load, or None when it looks
    whole (:func:`checked`)."""
    return examine(path)[0]


def examine(path: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """:func:`load_problem` and the checkpoint's save key (None where it has a problem)."""
    location = os.fspath(path)
    store: Store = LocalStore(location)
    try:
        doc = read_manifest_doc(store, location)
        if doc.doc.get("compression") is not None:  # a compressed mirror: its files are .dcz
            store = seams.decoded_store(store, doc, location)
        manifest, problems, _ = checked(store, location)
    except (OSError, DCPNVMeError) as exc:
        return one_line(exc), None
    if problems and manifest.node_local:  # each node judges its own disk: the nodes may disagree
        problems.append("this is this node's copy of a node-local checkpoint, which other nodes may still "
                        "take: give every node the same step")
    return ("; ".join(problems), None) if problems else (None, manifest.save_key)


def quick_check(source: Store, manifest: Manifest) -> tuple[list[str], list[str]]:
    """Listed files (the tables, the data files) that are missing or have the wrong size (a stat
    each, no data read), and of a node-local checkpoint the nodes whose data files are all
    absent: held on their own disks, not missing, as long as this directory holds at least one
    node's files."""
    problems, missing = [], set()
    try:
        listed = [(entry["name"], int(entry["size"])) for _, entry in tables_of(manifest.doc)]
        listed += [(f["name"], int(f["size"])) for f in manifest.doc["files"]]
    except (KeyError, TypeError, ValueError) as exc:
        return [f"{MANIFEST} lists its files or tables malformed ({one_line(exc)})"], []
    for name, size in listed:
        try:
            actual = source.size(name)  # a regular file, or refused unopened
        except FileNotFoundError:
            missing.add(name)
            continue
        except DCPNVMeError as exc:
            problems.append(one_line(exc))
            continue
        if actual != size:
            problems.append(f"{name} is {actual} bytes, the manifest says {size}")
    elsewhere = []
    if manifest.node_local and missing:
        by_node = manifest.files_by_node()
        absent = [node for node, names in by_node.items() if set(names) <= missing]
        if len(absent) < len(by_node):
            elsewhere = absent
            missing -= {name for node in absent for name in by_node[node]}
    problems += [f"{name} is missing" for name, _ in listed if name in missing]
    return problems, elsewhere


def one_line(exc: BaseException) -> str:
    """An error's first line, for a reason given in one line."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
