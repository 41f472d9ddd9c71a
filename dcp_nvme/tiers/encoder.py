"""Byte-grouped coding of a rank file's windows on a bounded thread pool, in order, with the
figures of what it coded."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import crc32c

from dcp_nvme.format.manifest import Manifest
from dcp_nvme.format.pieces import Piece
from dcp_nvme.tiers import codec

DEPTH = 2
"""Windows coding at once: one being finished and written while the next keeps the pool busy."""


Window = tuple[bytes, list[codec.Chunk], int, "Sequence[bytes | memoryview | None] | None"]
"""(decoded bytes, the chunks inside them, their file offset, each chunk's base bytes (None:
coded full), or None for no delta at all)."""


def regions(manifest: Manifest, name: str) -> list[tuple[int, int, str | None]]:
    """(offset, length, dtype) of each tensor in one rank file; non-tensor items are plain."""
    return [(c.byte_offset, c.length, c.dtype if c.kind == "tensor" else None)
            for c in manifest.chunks if c.file == name]


def chunks_in(spans: list[tuple[int, int, str | None]], piece: Piece,
              chunk_size: int = codec.DEFAULT_CHUNK) -> list[codec.Chunk]:
    """The codec chunks of one piece of a rank file (file offsets), tensors clipped to it."""
    lo, hi = piece.offset, piece.offset + piece.length
    clipped = [(max(o, lo) - lo, min(o + n, hi) - max(o, lo), d) for o, n, d in spans if o < hi and o + n > lo]
    return [codec.Chunk(c.offset + lo, c.length, c.planes) for c in codec.plan_chunks(piece.length, clipped, chunk_size)]


@dataclass
class CodecStats:
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time of the codec threads (thread time: the training job's threads are not counted)."""
    files: dict[str, dict[str, int | str]] = field(default_factory=dict)
    """Per original file: its stored name and sizes (a delta's base name and delta bytes too)."""

    @property
    def ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else 1.0


class Encoder:
    """A bounded pool of codec threads, its CPU time counted."""

    def __init__(self, threads: int, level: int) -> None:
        self.level = level
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="dcp-nvme-codec")
        self.cpu = 0.0
        self._lock = threading.Lock()
        self.alive = 0
        """Windows submitted to the pool whose results are not yet handed on (their bytes are held)."""
        self.peak = 0
        """Most windows alive at once: the memory bound (tests check it)."""

    def _submit(self, data: bytes, chunks: list[codec.Chunk], origin: int,
                bases: Sequence[bytes | memoryview | None] | None) -> list[Future[tuple[bytes, int]]]:
        view = memoryview(data)

        def one(chunk: codec.Chunk, base: bytes | memoryview | None) -> tuple[bytes, int]:
            started = time.thread_time()
            lo, hi = chunk.offset - origin, chunk.offset - origin + chunk.length
            piece = view[lo:hi]
            out = codec.encode_chunk(piece, chunk.planes, self.level, base), crc32c.crc32c(piece)
            with self._lock:
                self.cpu += time.thread_time() - started
            return out

        return [self.pool.submit(one, chunk, bases[i] if bases is not None else None)
                for i, chunk in enumerate(chunks)]

    def code_windows(self, windows: Iterable[Window], depth: int = DEPTH) -> Iterator[list[tuple[bytes, int]]]:
        """Each window's coded chunks, in order, with the next ``depth - 1`` windows already
        coding on the pool meanwhile (the pool never idles between windows); at most ``depth``
        windows' bytes are held at once."""
        pending: deque[list[Future[tuple[bytes, int]]]] = deque()
        source = iter(windows)
        try:
            while True:
                while len(pending) < depth:
                    window = next(source, None)
                    if window is None:
                        break
                    pending.append(self._submit(*window))
                    self._alive(+1)
                if not pending:
                    return
                coded = [future.result() for future in pending[0]]
                pending.popleft()
                self._alive(-1)
                yield coded
        finally:
            for futures in pending:  # abandoned (a failure): let no window outlive the call
                for future in futures:
                    future.cancel()
                self._alive(-1)

    def _alive(self, change: int) -> None:
        with self._lock:
            self.alive += change
            self.peak = max(self.peak, self.alive)

    def close(self) -> None:
        self.pool.shutdown()
