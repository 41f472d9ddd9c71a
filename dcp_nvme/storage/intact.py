"""Whether a committed dcp_nvme checkpoint's files are all there, at the sizes its manifest
records: a stat each, no table or data read. ``dcp-nvme list`` calls a checkpoint that fails
this damaged; ``dcp_nvme.latest`` passes over it."""

from __future__ import annotations

import os

from dcp_nvme import seams
from dcp_nvme.errors import DCPNVMeError
from dcp_nvme.format.container import MANIFEST, tables_of
from dcp_nvme.format.manifest import Manifest, read_manifest_doc
from dcp_nvme.storage.local_dir import LocalStore, Store


def load_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the committed dcp_nvme checkpoint at ``path`` cannot load, or None when it looks
    whole: ``manifest.json`` parsed and checked, and every file it lists present at its size
    (:func:`quick_check`). A stat per file, no table or data read."""
    location = os.fspath(path)
    store: Store = LocalStore(location)
    try:
        manifest = read_manifest_doc(store, location)
        if manifest.doc.get("compression") is not None:  # a compressed mirror: its files are .dcz
            store = seams.decoded_store(store, manifest, location)
        problems, _ = quick_check(store, manifest)
    except (OSError, DCPNVMeError) as exc:
        return one_line(exc)
    if problems and manifest.node_local:  # each node judges its own disk: the nodes may disagree
        problems.append("this is this node's copy of a node-local checkpoint, which other nodes may still "
                        "take: give every node the same step")
    return "; ".join(problems) or None


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
