"""``verify_mirror``: read a drained checkpoint back from its target and check every byte
against the local blocks table."""

from __future__ import annotations

import os
import time
from typing import Any

from dcp_nvme.errors import DrainError
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.tiers.coded import readback_coded, same_save
from dcp_nvme.tiers.drainer import DrainResult, readback
from dcp_nvme.tiers.journal import FAILED, DrainBusy, Journal, drain_lock
from dcp_nvme.tiers.options import DrainOptions
from dcp_nvme.tiers.sinks import open_sink
from dcp_nvme.tiers.source import DrainSource
from dcp_nvme.tiers.transfer import (
    IncompleteOnTarget,
    classify,
)


def verify_mirror(local: str | os.PathLike, target: str, *, storage_options: dict[str, Any] | None = None,
                  filesystem: Any = None, options: DrainOptions | None = None) -> DrainResult:
    """Read every byte of a drained checkpoint back from its target and check it against the
    local blocks table. A mismatch marks the drain ``failed: checksum mismatch`` and raises."""
    options = options or DrainOptions(verify="readback")
    location = os.fspath(local)
    try:
        with drain_lock(location, target):
            return _verify_locked(location, target, storage_options, filesystem, options)
    except DrainBusy as exc:
        raise DrainError(location, target, str(exc)) from exc


def _verify_locked(location: str, target: str, storage_options: dict[str, Any] | None, filesystem: Any,
                   options: DrainOptions) -> DrainResult:
    source = DrainSource(location)
    journal = Journal.open(location, target, source.save_key)
    result = DrainResult(location, target, source.save_key, int(source.manifest.doc.get("total_bytes", 0)))
    started = time.perf_counter()
    sink = open_sink(target, storage_options, filesystem)
    try:
        if not sink.has(MANIFEST):
            raise IncompleteOnTarget(f"{sink.location(MANIFEST)} is missing: the target holds no "
                                     "committed checkpoint")
        remote = sink.read_small(MANIFEST)
        if remote != source.manifest_bytes and not same_save(remote, source.manifest_bytes):
            raise IncompleteOnTarget(f"{sink.location(MANIFEST)} is not the manifest of save "
                                     f"{source.save_key} (the target holds another save)")
        if remote != source.manifest_bytes:  # a compressed mirror: decode every chunk and check it
            result.bytes_verified_remote += readback_coded(sink.store, sink.target, source.files,
                                                           options.part_size)
        else:
            for name in source.manifest.file_names:
                readback(sink, source.files[name], options.part_size, options, result)
    except Exception as exc:
        journal.update(state=FAILED, cause=classify(exc))
        raise
    result.seconds = time.perf_counter() - started
    return result
