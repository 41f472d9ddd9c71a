"""The bounded stager's hand-off to the writer (``NVMeStager(max_bytes=...)``): a staged save's
state holds some of the caller's live tensors, and its ``staging_completion`` resolves as soon
as the save has written them, before the rest of the file (``WaveRelease``).

The stager attaches the release to the thread that takes the staged state (``attach``), and the
writer on that thread finds it there (``taken``): only the save that took the state releases
its training, never another save that happens to write the same tensors."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

_ATTRIBUTE = "dcp_nvme_wave"
"""Attribute of a save thread: the ``WaveRelease`` of the staged state it took."""


class WaveRelease:
    """Resolves one save's staging Future once its live tensors have been written (or the save
    ended, whatever way)."""

    def __init__(self, live_addresses: set[int], resolve: Callable[[BaseException | None], None]) -> None:
        self.live = live_addresses
        self._resolve = resolve
        self._done = False
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        self.boundary = 0  # bytes of the data region to be written before the live tensors are free

    def release(self, error: BaseException | None = None) -> None:
        with self._guard:
            if self._done:
                return
            self._done = True
            thread = self._thread
        if thread is not None and getattr(thread, _ATTRIBUTE, None) is self:
            delattr(thread, _ATTRIBUTE)  # a thread that runs many saves takes the next one clean
        self._resolve(error)

    def progress(self, written_prefix: int) -> None:
        """The writer's contiguous written prefix of the data region grew to ``written_prefix``."""
        if written_prefix >= self.boundary:
            self.release()


def attach(thread: threading.Thread, release: WaveRelease) -> None:
    """``thread`` took the staged state whose live tensors ``release`` frees."""
    with release._guard:
        if release._done:
            return
        release._thread = thread
    setattr(thread, _ATTRIBUTE, release)


def taken(sources: Sequence) -> WaveRelease | None:
    """The release the stager attached to this thread, when its live tensors are among
    ``sources`` (flat uint8 tensors in write order), with its boundary set to where the last of
    them ends; None when there is none."""
    release = getattr(threading.current_thread(), _ATTRIBUTE, None)
    if release is None:
        return None
    ends = [i for i, s in enumerate(sources)
            if s.device.type == "cpu" and s.untyped_storage().data_ptr() in release.live]
    if not ends:
        return None
    release.boundary = sum(int(s.numel()) for s in sources[: ends[-1] + 1])
    return release
