"""Where drained bytes go. One small interface, three implementations:

- ``LocalSink``: a second directory (a parallel filesystem mount): pieces are pwritten into a
  hidden partial file and fsynced, the file is renamed into place when complete. Resumes per piece.
- ``S3Sink``: an s3fs target: one multipart upload per file, one part per piece, completed when
  every part is in. The upload id and part ETags live in the journal, so a restarted drain
  continues the same upload (``list_parts`` says what the server still has). Resumes per piece.
- ``StreamSink``: any other fsspec filesystem: a file is streamed in order through
  ``fs.open(path, "wb")``. Resumes per file.

Small files (tables, manifest) go through ``put_small``, which is atomic on every target.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from fsspec.asyn import sync

from ..errors import BucketMissingError
from ..remote import FsspecStore, filesystem, is_local_fs
from ..store import LocalStore, fsync_dir, is_remote_url, local_path
from .plan import Piece


class Sink:
    """Interface (and the shared small-file side, through a store)."""

    ordered = False
    """True when a file's pieces must be sent in order by one thread (no random-access writes)."""

    def __init__(self, target: str, store) -> None:
        self.target = target
        self.store = store

    def location(self, name: str) -> str:
        return f"{self.target.rstrip('/')}/{name}"

    def prepare(self) -> None:
        self.store.make()

    def remote_size(self, name: str) -> int | None:
        try:
            return self.store.size(name)
        except FileNotFoundError:
            return None

    def begin(self, name: str, size: int, entry: dict[str, Any]) -> None:
        """Open (or re-open) the transfer of one file; drop journal pieces the target lost."""

    def put_piece(self, name: str, piece: Piece, data: bytes, entry: dict[str, Any]) -> str:
        """Send one piece; returns a tag the journal keeps (an ETag on S3)."""
        raise NotImplementedError

    def finish(self, name: str, pieces: list[Piece], entry: dict[str, Any]) -> None:
        """Every piece is in: make the file visible under its name."""

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self.store.read_range(name, start, end)

    def put_small(self, name: str, data: bytes) -> None:
        self.store.write_atomic(name, data)

    def names(self) -> list[str]:
        return self.store.names()

    def remove(self, name: str) -> None:
        self.store.remove(name)

    def has(self, name: str) -> bool:
        return self.store.has(name)


class _LocalReadStore(LocalStore):
    def read_range(self, name: str, start: int, end: int) -> bytes:
        with open(self.path(name), "rb") as handle:
            handle.seek(start)
            return handle.read(end - start)


class LocalSink(Sink):
    def __init__(self, target: str) -> None:
        root = local_path(target)
        super().__init__(target, _LocalReadStore(root))
        self.root = root

    def _partial(self, name: str) -> str:
        return os.path.join(self.root, f".{name}.drain-partial")

    def begin(self, name: str, size: int, entry: dict[str, Any]) -> None:
        partial = self._partial(name)
        if entry["pieces"] and not os.path.exists(partial):
            entry["pieces"] = {}  # the partial file vanished: start the file again
        if not entry["pieces"]:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.close(fd)

    def put_piece(self, name: str, piece: Piece, data: bytes, entry: dict[str, Any]) -> str:
        fd = os.open(self._partial(name), os.O_WRONLY)
        try:
            view, offset = memoryview(data), piece.offset
            while len(view):
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
            os.fsync(fd)  # durable before the journal says so
        finally:
            os.close(fd)
        return ""

    def finish(self, name: str, pieces: list[Piece], entry: dict[str, Any]) -> None:
        os.replace(self._partial(name), os.path.join(self.root, name))
        fsync_dir(self.root)


class S3Sink(Sink):
    def __init__(self, target: str, fs) -> None:
        super().__init__(target, FsspecStore(target, fs=fs))
        self.fs = fs

    def _call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        return sync(self.fs.loop, self.fs._call_s3, method, **kwargs)

    def _key(self, name: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.store.path(name))
        return bucket, key

    def prepare(self) -> None:
        # Fail early and clearly when the bucket is missing (exists() would just say False).
        bucket, _ = self._key("x")
        self.fs.invalidate_cache(bucket)
        try:
            self.fs.ls(bucket)
        except FileNotFoundError as exc:
            raise BucketMissingError(f"bucket {bucket!r} does not exist ({exc}); create it or fix "
                                     "the target URL") from exc

    def begin(self, name: str, size: int, entry: dict[str, Any]) -> None:
        bucket, key = self._key(name)
        upload = entry.get("upload_id")
        if upload:
            try:
                listed = self._call("list_parts", Bucket=bucket, Key=key, UploadId=upload)
            except FileNotFoundError:  # NoSuchUpload: aborted, expired, or the server lost it
                listed = None
            if listed is not None:
                have = {p["PartNumber"]: p["ETag"] for p in listed.get("Parts", [])}
                entry["pieces"] = {i: tag for i, tag in entry["pieces"].items() if have.get(int(i) + 1) == tag}
                return
        entry["pieces"] = {}
        entry["upload_id"] = self._call("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]

    def put_piece(self, name: str, piece: Piece, data: bytes, entry: dict[str, Any]) -> str:
        bucket, key = self._key(name)
        answer = self._call("upload_part", Bucket=bucket, Key=key, UploadId=entry["upload_id"],
                            PartNumber=piece.index + 1, Body=data)
        return answer["ETag"]

    def finish(self, name: str, pieces: list[Piece], entry: dict[str, Any]) -> None:
        bucket, key = self._key(name)
        parts = [{"PartNumber": p.index + 1, "ETag": entry["pieces"][str(p.index)]} for p in pieces]
        try:
            self._call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=entry["upload_id"],
                       MultipartUpload={"Parts": parts})
        except FileNotFoundError:
            # Completed by an earlier run that died before its journal said so? The object's
            # multipart ETag (md5 of the part md5s) proves it is exactly these parts.
            if not self._has_etag(name, multipart_etag([p["ETag"] for p in parts])):
                raise
        entry.pop("upload_id", None)
        self.fs.invalidate_cache(self.store.path(name))

    def _has_etag(self, name: str, etag: str) -> bool:
        self.fs.invalidate_cache(self.store.path(name))
        try:
            return self.fs.info(self.store.path(name)).get("ETag", "").strip('"') == etag
        except FileNotFoundError:
            return False


def multipart_etag(part_etags: list[str]) -> str:
    digest = hashlib.md5(b"".join(bytes.fromhex(e.strip('"')) for e in part_etags))
    return f"{digest.hexdigest()}-{len(part_etags)}"


class StreamSink(Sink):
    ordered = True

    def __init__(self, target: str, fs) -> None:
        super().__init__(target, FsspecStore(target, fs=fs))
        self.fs = fs
        self.handles: dict[str, Any] = {}

    def begin(self, name: str, size: int, entry: dict[str, Any]) -> None:
        entry["pieces"] = {}  # no random-access writes: a file is resent whole
        self.handles[name] = self.fs.open(self.store.path(name), "wb")

    def put_piece(self, name: str, piece: Piece, data: bytes, entry: dict[str, Any]) -> str:
        self.handles[name].write(data)
        return ""

    def finish(self, name: str, pieces: list[Piece], entry: dict[str, Any]) -> None:
        self.handles.pop(name).close()


def open_sink(target: str, storage_options: dict[str, Any] | None = None, filesystem_=None) -> Sink:
    """The sink for a target URL or path; ``filesystem_`` overrides building one from options."""
    if not is_remote_url(target) and filesystem_ is None:
        return LocalSink(target)
    fs = filesystem_ if filesystem_ is not None else filesystem(target, storage_options)[0]
    if is_local_fs(fs):
        return LocalSink(fs._strip_protocol(target))
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "s3" in protocol and hasattr(fs, "_call_s3"):
        return S3Sink(target, fs)
    return StreamSink(target, fs)
