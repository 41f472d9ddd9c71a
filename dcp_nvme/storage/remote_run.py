"""A run directory in an object store (any fsspec URL: ``s3://bucket/run``): its steps, whether
each can load, the newest. What ``dcp_nvme.latest`` and ``dcp-nvme list|status`` do for a URL.

One listing of the run's prefix, then per step its ``manifest.json`` and the size of each file
it lists (``storage.intact.quick_check``): no table or data read. A step is a prefix directly
under the run's that holds ``manifest.json`` (a drain writes it last: its presence means the
mirror is committed). Steps are ordered by the step in their names (``storage.step_names.parse_step``)
when every name carries one, else by their manifests' creation times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dcp_nvme import seams
from dcp_nvme.errors import DCPNVMeError, ManifestError
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.manifest import read_manifest_doc
from dcp_nvme.host.files import bare_name
from dcp_nvme.storage.fsspec_dir import FsspecStore, filesystem
from dcp_nvme.storage.intact import one_line, quick_check
from dcp_nvme.storage.step_names import first_loadable, parse_step


@dataclass(frozen=True)
class RemoteStep:
    """One prefix directly under a remote run's."""

    url: str
    name: str
    step: int | None
    store: FsspecStore
    """The step's files, through the run's filesystem (one client for the whole run)."""
    names: tuple[str, ...] = ()
    """The objects directly under the step's prefix, as listed."""
    bytes: int = 0
    """Their bytes (what the step costs in the store)."""

    @property
    def committed(self) -> bool:
        return MANIFEST in self.names


def remote_steps(url: str, storage_options: dict[str, Any] | None = None, *, fs: Any = None) -> list[RemoteStep] | None:
    """The prefixes directly under the run at ``url``, by name; None when nothing is stored
    under ``url`` (no such bucket or prefix). A name that is not a plain one is skipped.
    ``fs``: a filesystem already open on the store (else one from ``storage_options``)."""
    if fs is None:
        fs, root = filesystem(url, storage_options)
    else:
        root = fs._strip_protocol(url).rstrip("/")
    fs.invalidate_cache(root)  # another process (a drain) writes here
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return None
    if not entries:
        return None
    run = url.rstrip("/")
    steps = []
    for entry in entries:
        if entry.get("type") != "directory":
            continue
        try:
            name = bare_name(str(entry["name"]).rstrip("/").rsplit("/", 1)[-1])
        except ManifestError:
            continue
        store = FsspecStore(f"{run}/{name}", fs=fs)
        steps.append(RemoteStep(store.url, name, parse_step(name), store, *_listed(fs, store.root)))
    return sorted(steps, key=lambda s: s.name)


def listed_step(store: FsspecStore) -> RemoteStep:
    """``store`` (one step's prefix) as a RemoteStep, its objects listed."""
    name = store.url.rsplit("/", 1)[-1]
    return RemoteStep(store.url, name, parse_step(name), store, *_listed(store.fs, store.root))


def _listed(fs: Any, root: str) -> tuple[tuple[str, ...], int]:
    """(names, bytes) of the objects directly under ``root``: one listing."""
    try:
        files = [e for e in fs.ls(root, detail=True) if e.get("type") == "file"]
    except FileNotFoundError:
        return (), 0
    return (tuple(sorted(str(e["name"]).rsplit("/", 1)[-1] for e in files)),
            sum(int(e.get("size") or 0) for e in files))


def step_problem(store: FsspecStore) -> str | None:
    """Why the committed step at ``store`` cannot load, or None when it looks whole: its manifest
    parsed and checked, every file it lists present at its size (a compressed mirror's coded
    files at theirs). A mirror holds every node's files, so none may be missing."""
    location = store.url
    try:
        manifest = read_manifest_doc(store, location)
        view = store if manifest.compression is None else seams.decoded_store(store, manifest, location)
        problems, elsewhere = quick_check(view, manifest)
    except (OSError, DCPNVMeError) as exc:
        return one_line(exc)
    problems += [f"the files node {node} wrote are missing" for node in elsewhere]
    return "; ".join(problems) or None


def _created(step: RemoteStep) -> float:
    try:
        return read_manifest_doc(step.store, step.url).created_unix or 0.0
    except (OSError, DCPNVMeError):
        return 0.0


def latest_remote(url: str, storage_options: dict[str, Any] | None = None,
                  extra_markers: tuple[str, ...] = ()) -> str | None:
    """The URL of the newest committed step under the remote run at ``url`` that can load, or
    None when it has none (an empty or absent prefix: a fresh start). A newer committed step
    that cannot load is passed over with a warning naming it and why. ``extra_markers``: names
    a step must also hold (e.g. Megatron's ``metadata.json``)."""
    steps = remote_steps(url, storage_options) or []
    committed = [s for s in steps if s.committed and all(m in s.names for m in extra_markers)]
    if all(s.step is not None for s in committed):
        committed.sort(key=lambda s: (s.step, s.name), reverse=True)
    else:
        committed.sort(key=lambda s: (_created(s), s.name), reverse=True)
    found = first_loadable(committed, lambda s: step_problem(s.store), lambda s: s.url, lambda s: s.step, url,
                           stacklevel=4)
    return None if found is None else found.url
