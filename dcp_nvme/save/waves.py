"""Bounded staging: the hand-off between an ``NVMeStager(max_bytes=...)`` and the writer.

When the state does not fit in ``max_bytes``, the stager copies only the tensors at the end of
the write order into its arena and hands the save the earlier ones as they are (live). The save
runs in two waves: the writer first writes the live tensors, and the moment its contiguous
written prefix of the data region passes the last of them the stager's Future resolves
(``staging_completion``: training may change its tensors again); the staged rest is written in
the background. This module is the meeting point: the stager registers a :class:`WaveRelease`
for the live tensors' storages; the writer finds it from its sources and reports progress.
No torch import here beyond the tensors it is given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

_lock = threading.Lock()
_pending: list[WaveRelease] = []


class WaveRelease:
    """Resolves one save's staging Future once its live tensors have been written (or the save
    ended, whatever way)."""

    def __init__(self, live_addresses: set[int], resolve: Callable[[BaseException | None], None]) -> None:
        self.live = live_addresses
        self._resolve = resolve
        self._done = False
        self._guard = threading.Lock()
        self.boundary = 0  # bytes of the data region to be written before the live tensors are free

    def release(self, error: BaseException | None = None) -> None:
        with self._guard:
            if self._done:
                return
            self._done = True
        with _lock:
            if self in _pending:
                _pending.remove(self)
        self._resolve(error)

    def progress(self, written_prefix: int) -> None:
        """The writer's contiguous written prefix of the data region grew to ``written_prefix``."""
        if written_prefix >= self.boundary:
            self.release()


def register(release: WaveRelease) -> None:
    with _lock:
        _pending.append(release)


def release_for(sources: Sequence) -> WaveRelease | None:
    """The pending release whose live tensors are among ``sources`` (flat uint8 tensors in write
    order), with its boundary set to where the last of them ends; None when there is none."""
    addresses = [s.untyped_storage().data_ptr() if s.device.type == "cpu" else None for s in sources]
    with _lock:
        candidates = list(reversed(_pending))  # the newest save first
    for release in candidates:
        ends = [i for i, a in enumerate(addresses) if a is not None and a in release.live]
        if ends:
            release.boundary = sum(int(s.numel()) for s in sources[: ends[-1] + 1])
            return release
    return None
