"""The checkpoints of a run directory: which are committed, their steps, the newest.

One home for "find the checkpoints of a run", used by the integrations, retention, listing
and status. ``checkpoints`` is pure directory inspection (no manifest is parsed); ``latest``
also parses the newest candidates' ``manifest.json`` and stats the files it lists
(``storage.intact``, which ``dcp-nvme list`` uses too), so that it passes over a checkpoint
that cannot load. No data is read.

A checkpoint is a real directory (never a symlink) directly under the run directory that holds
a regular-file commit marker: ``manifest.json`` (dcp_nvme) or ``.metadata`` (DCP's
FileSystemWriter). Steps are read from the usual names: ``step_N``, ``step-N``, ``stepN``,
``global_stepN``, Lightning's ``epoch=E-step=N`` (``.ckpt`` suffix allowed), Megatron's ``iter_NNNNNNN``,
``checkpoint-N`` and a bare ``N``.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcp_nvme.errors import InvalidInputError
from dcp_nvme.storage.step_names import first_loadable, parse_step

NVME_MARKER = "manifest.json"
"""dcp_nvme's commit marker: renamed into place last, so its presence means committed."""
DCP_MARKER = ".metadata"
"""The commit marker of DCP's FileSystemWriter (a plain DCP checkpoint)."""

NVME = "nvme"
DCP = "dcp"
_MARKERS = {NVME: NVME_MARKER, DCP: DCP_MARKER}



@dataclass(frozen=True)
class CheckpointDir:
    """A committed checkpoint directory of a run."""

    path: Path
    step: int | None
    kind: str
    """``"nvme"`` (dcp_nvme's format) or ``"dcp"`` (DCP's FileSystemWriter)."""
    committed_ns: int
    """When its commit marker was written (mtime, ns): the order when names carry no step."""

    @property
    def name(self) -> str:
        return self.path.name


def _regular_file(path: str) -> os.stat_result | None:
    """lstat of ``path`` when it is a regular file (not a link, FIFO or device), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def committed_kind(path: str | os.PathLike, kinds: Iterable[str] = (NVME, DCP)) -> str | None:
    """``"nvme"``/``"dcp"`` when ``path`` is a real directory holding that commit marker."""
    path = os.fspath(path)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
    except OSError:
        return None
    for kind in kinds:
        if _regular_file(os.path.join(path, _MARKERS[kind])) is not None:
            return kind
    return None


def checkpoints(
    run_dir: str | os.PathLike[str],
    *,
    kinds: Iterable[str] = (NVME, DCP),
    extra_markers: Iterable[str] = (),
) -> list[CheckpointDir]:
    """Committed checkpoints directly under ``run_dir``, oldest first, newest last.

    Newest means the highest step when every checkpoint's name carries one (ties by commit
    time), else the latest commit. Symlinked entries are never followed, so a ``latest`` link
    can neither be counted twice nor lead outside the run directory. ``extra_markers`` are
    names that must also exist in a checkpoint (e.g. Megatron's ``metadata.json``). A missing
    ``run_dir`` has no checkpoints.
    """
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in _MARKERS]
    if unknown:
        raise InvalidInputError(f"unknown checkpoint kind(s) {unknown}; expected some of {sorted(_MARKERS)}")
    extra_markers = tuple(extra_markers)
    try:
        entries = list(os.scandir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        kind = committed_kind(entry.path, kinds)
        if kind is None:
            continue
        if any(not os.path.exists(os.path.join(entry.path, m)) for m in extra_markers):
            continue
        marker = _regular_file(os.path.join(entry.path, _MARKERS[kind]))
        if marker is None:  # removed between the two looks
            continue
        found.append(CheckpointDir(Path(entry.path), parse_step(entry.name), kind, marker.st_mtime_ns))
    if found and all(c.step is not None for c in found):
        found.sort(key=lambda c: (c.step, c.committed_ns, c.name))
    else:
        found.sort(key=lambda c: (c.committed_ns, c.name))
    return found


def latest(
    run_dir: str | os.PathLike[str],
    *,
    kinds: Iterable[str] = (NVME,),
    extra_markers: Iterable[str] = (),
    agree: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Path | str | None:
    """The newest committed dcp_nvme checkpoint under ``run_dir`` (see :func:`checkpoints`) that
    can load, or None when the run directory holds none yet: one ``NVMeReader`` loads. A newer
    one that cannot (its manifest or a table is damaged, or a data file it lists is missing or of
    another size: ``storage.intact``, the check by which ``dcp-nvme list`` calls it corrupt or
    damaged; no data read) is passed over with a warning naming it and why. The newest
    candidates are checked first and the walk stops at the first that passes. A stock DCP
    checkpoint in the same run is passed over unless ``kinds`` names ``"dcp"`` too
    (``checkpoints()`` lists both, each with its ``kind``); it is taken as committed, unchecked.
    A ``run_dir`` that does not exist (a typo would otherwise start training from scratch)
    raises CheckpointNotFoundError: create it before the first save.

    ``agree=True``: every rank of the job calls it (a collective over the default group), and
    every rank gets the same step: the newest one that every node can load. Node-local disks can
    disagree -- a commit killed between the first node's rename and the last's, a copy damaged
    on one node -- and a restart that took each node's own newest would load one model from two
    steps. A node that holds the newest step prepared but not renamed (its vote was in, the
    commit was decided: another node renamed it) is rolled forward; a step some node lacks is
    passed over, with a warning naming the node. The ranks walk down from the newest step
    together, each checking only the steps it must. The run directory must exist on some node
    (on a node without it, that node holds nothing). In one process it is ``latest`` itself.

    ``run_dir`` may be a URL (``s3://bucket/run``, any fsspec URL; ``storage_options`` go to its
    filesystem): the newest step there that can load, as a URL (str), for
    ``NVMeReader(url, storage_options=...)`` (``storage.remote_run``). Every rank sees the same
    store: with ``agree`` rank 0 asks it and tells the others (a drain that commits meanwhile
    cannot split them)."""
    from dcp_nvme.storage.local_dir import is_remote_url

    if is_remote_url(run_dir):
        from dcp_nvme.storage.remote_run import latest_remote  # here: fsspec only for a URL

        if not (agree and _several_ranks()):
            return latest_remote(os.fspath(run_dir), storage_options, tuple(extra_markers))
        return _told_by_rank_0(lambda: latest_remote(os.fspath(run_dir), storage_options, tuple(extra_markers)))
    if storage_options is not None:
        raise InvalidInputError(f"latest({os.fspath(run_dir)!r}): storage_options are for a URL run "
                                "directory (s3://bucket/run); a local directory takes none")
    if agree and _several_ranks():
        return _agreed(run_dir, tuple(kinds), tuple(extra_markers))
    from dcp_nvme.storage.intact import load_problem  # here, so that `import dcp_nvme` loads no pyarrow

    found_all = checkpoints(run_dir, kinds=kinds, extra_markers=extra_markers)
    if not found_all and not os.path.isdir(run_dir):
        raise _missing_run_dir(run_dir)
    found = first_loadable(reversed(found_all), lambda c: load_problem(c.path) if c.kind == NVME else None,
                           lambda c: str(c.path), lambda c: c.step, os.fspath(run_dir), stacklevel=3)
    return None if found is None else found.path


def _missing_run_dir(run_dir: str | os.PathLike[str]) -> Exception:
    from dcp_nvme.errors import CheckpointNotFoundError

    what = "is not a directory" if os.path.lexists(run_dir) else "does not exist"
    return CheckpointNotFoundError(f"dcp_nvme.latest: the run directory {os.fspath(run_dir)} {what}: create it "
                                   "(os.makedirs(run_dir, exist_ok=True) before the first save) or fix the path")


def _prepared_key(step: str, kinds: tuple[str, ...]) -> str | None:
    """The save key of the manifest prepared but not renamed in ``step``, else None."""
    from dcp_nvme.format.container import MANIFEST, temp_of

    try:
        keys = [t[1] for t in map(temp_of, os.listdir(step)) if t is not None and t[0] == MANIFEST]
    except OSError:
        return None
    return keys[0] if len(keys) == 1 and committed_kind(step, kinds) is None else None


def _told_by_rank_0(find: Any) -> Any:
    """``find()`` on rank 0, its answer (or its error, raised on every rank) on all."""
    import torch.distributed as dist

    from dcp_nvme.errors import DCPNVMeError

    said: list[Any] = [None]
    failed: Exception | None = None
    if dist.get_rank() == 0:
        try:
            said = [(find(), None)]
        except Exception as exc:  # noqa: BLE001  every rank hears it (as text: any error pickles)
            failed, said = exc, [(None, f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(said, src=0)
    found, error = said[0]
    if failed is not None:
        raise failed
    if error is not None:
        raise DCPNVMeError(f"latest(agree=True) on rank 0: {error}")
    return found


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_LOADABLE, _PREPARED = "loadable", "prepared"


def _agreed(run_dir: str | os.PathLike[str], kinds: tuple[str, ...], extra_markers: tuple[str, ...]) -> Path | None:
    """Every rank lists its committed steps (no file read); then, from the newest step down, the
    ranks say together which is the newest step each holds whole (loadable or prepared) and
    with which save, until they all name the same step and save. A rank checks a step only on
    its way down to its own offer, so an intact newest step costs one check per rank."""
    import torch.distributed as dist

    from dcp_nvme.errors import DCPNVMeError
    from dcp_nvme.format.container import MANIFEST
    from dcp_nvme.host.job import node_identity
    from dcp_nvme.storage.intact import examine, load_problem
    from dcp_nvme.storage.local_dir import commit_prepared

    world, node = dist.get_world_size(), node_identity()
    found = {c.name: c for c in checkpoints(run_dir, kinds=kinds, extra_markers=extra_markers)}
    listed: list[Any] = [None] * world
    dist.all_gather_object(listed, (os.path.isdir(run_dir), list(reversed(found))))
    if not any(exists for exists, _ in listed):
        raise _missing_run_dir(run_dir)
    names = list(dict.fromkeys(n for _, mine in listed for n in mine))  # rank 0's order first
    names.sort(key=lambda n: (parse_step(n) is None, -(parse_step(n) or 0)))  # newest step first
    checked: dict[str, tuple[str | None, str | None, str | None]] = {}

    def status(name: str) -> tuple[str | None, str | None, str | None]:
        """(loadable/prepared/None, save key, why it cannot load) of ``name`` on this rank."""
        if name not in checked:
            if name in found:
                why, key = examine(found[name].path) if found[name].kind == NVME else (None, None)
                checked[name] = (None, None, why) if why else (_LOADABLE, key, None)
            else:
                key = _prepared_key(os.path.join(os.fspath(run_dir), name), kinds)
                checked[name] = (_PREPARED if key else None, key, None)
        return checked[name]

    chosen, at, first = None, 0, None
    while at < len(names):  # each rank offers its newest step from `at` down that it holds whole
        offer = next((i for i in range(at, len(names)) if status(names[i])[0] is not None), None)
        said: list[Any] = [None] * world
        dist.all_gather_object(said, (node, status(names[at]), offer))
        first = first or said
        offers = [o for _, _, o in said]
        if None in offers:  # a rank holds none of the steps left
            break
        if all(o == at for o in offers) and len({s[1] for _, s, _ in said}) == 1:
            chosen = names[at]
            break
        at = max(max(offers), at + 1)  # nothing newer than the oldest offer is on every rank
    why = None
    forward = chosen is not None and status(chosen)[0] == _PREPARED
    if forward and dist.get_rank() == min(r for r, (n, _, _) in enumerate(said) if n == node):
        step = os.path.join(os.fspath(run_dir), str(chosen))
        try:  # the commit was decided (another node renamed it): finish this node's half
            commit_prepared(step, MANIFEST, str(status(str(chosen))[1]))
            why = load_problem(step)
        except (OSError, DCPNVMeError) as exc:
            why = f"{type(exc).__name__}: {exc}"
    if chosen is not None and any(s[0] == _PREPARED for _, s, _ in said):
        ends: list[Any] = [None] * world
        dist.all_gather_object(ends, (node, why))
        for where, problem in ends:
            if problem:
                raise DCPNVMeError(f"latest(agree=True): node {where} could not finish its commit of {chosen} "
                                   f"under {os.fspath(run_dir)}: {problem}")
    if names and names[0] != chosen and first is not None:
        lacking = sorted({n for n, s, _ in first if s[0] is None})
        reasons = "; ".join(f"node {n}: {s[2]}" for n, s, _ in first if s[2])
        warnings.warn(f"dcp_nvme.latest: {names[0]} is not loadable on node(s) {', '.join(lacking) or 'any'}"
                      f"{f' ({reasons})' if reasons else ''}; every rank takes {chosen or 'nothing'}", stacklevel=3)
    return None if chosen is None else Path(run_dir) / chosen
