"""Where drained bytes go. One small interface, three implementations:

- ``LocalSink``: a second directory (a parallel filesystem mount): pieces are pwritten into a
  hidden partial file and fsynced, the file is renamed into place when complete. Resumes per
  piece: a piece the journal names is read back from the partial file and checked first.
- ``S3Sink``: an s3fs target: one multipart upload per file, one part per piece (sent with its
  Content-MD5), completed when every part is in. The upload id and part ETags live in the
  journal; a restarted drain continues the same upload, keeping a part only when ``ListParts``
  shows it with the piece's size and the md5 of the local piece's bytes.
- ``BotoS3Sink``: an ``s3://`` target through botocore itself (``tiers.s3_client``), the S3
  path wherever its options allow: one multipart upload per file with a CRC32C checksum, one
  part per piece on checksum-block boundaries, each part's ``x-amz-checksum-crc32c`` combined
  from the blocks table (no MD5, no signed payload: the server checks the crc). A restarted
  drain keeps a part only when ``ListParts`` shows it with the piece's size and crc32c.
- ``StreamSink``: any other fsspec filesystem: a file is streamed in order through
  ``fs.open(path, "wb")``. Resumes per file.

Small files (tables, manifest) go through ``put_small``, which is atomic on every target.
Nothing here trusts the journal: ``confirm_file`` and ``confirm_pieces`` say what the target
provably holds (size, and checksums of bytes read back or md5s the server reports).
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from collections.abc import Callable
from typing import Any

import crc32c
from fsspec.asyn import sync

from dcp_nvme.errors import BucketMissingError, ChecksumMismatchError
from dcp_nvme.format.checksums import checks_within, crc32c_combine, span_crc
from dcp_nvme.format.pieces import Piece, verify_piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.host.files import create_no_follow, fsync_dir, pwrite_all, write_file_fresh
from dcp_nvme.storage.fsspec_dir import FsspecStore, filesystem, is_local_fs
from dcp_nvme.storage.local_dir import LocalStore, is_remote_url, local_path
from dcp_nvme.tiers.s3_client import S3Store, b64_crc, object_store
from dcp_nvme.tiers.transfer import S3_MAX_PARTS, S3_MIN_PART, IncompleteOnTarget

LocalPiece = Callable[[FileRecord, Piece], bytes]
"""Reads one piece of a local data file, checked against the blocks table."""


def next_parts_page(answer: dict[str, Any], page: dict[str, Any], where: str, upload: str) -> dict[str, Any]:
    """The next ListParts page after a truncated ``answer``. The server's marker is input: it must
    move forward within S3's part numbers, or a store answering "truncated" with the same page
    would hold the drain in a loop."""
    marker = answer.get("NextPartNumberMarker")
    last = page.get("PartNumberMarker", 0)
    if not isinstance(marker, (int, str)) or not str(marker).isdigit() or not last < int(marker) < S3_MAX_PARTS:
        raise IncompleteOnTarget(f"{where}: ListParts of upload {upload} answered a next marker {marker!r} "
                                 f"after {last}; the store's listing cannot be trusted")
    return {"PartNumberMarker": int(marker)}


class Sink:
    """Interface (and the shared small-file side, through a store)."""

    ordered = False
    """True when a file's pieces must be sent in order by one thread (no random-access writes)."""
    min_part = 1
    """The smallest part the target takes (S3: 5 MiB, except the last)."""
    max_parts: int | None = None
    """The most parts one file may have on the target (S3: 10,000), None for no limit."""
    local_root: str | None = None
    """The target directory when it is on a local (or mounted) filesystem."""

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

    def confirm_file(self, name: str, record: FileRecord, pieces: list[Piece], local: LocalPiece) -> bool:
        """True when ``name`` is on the target, complete: its size, and every checksum block read
        back and checked. A file that cannot be confirmed is sent again."""
        if self.remote_size(name) != record.size:
            return False
        return all(self._read_back_ok(name, record, piece, name) for piece in pieces)

    def _read_back_ok(self, name: str, record: FileRecord, piece: Piece, source: str) -> bool:
        data = self.read_range(source, piece.offset, piece.offset + piece.length)
        if len(data) != piece.length:
            return False
        try:
            verify_piece(record, piece.offset, data, self.location(name))
        except ChecksumMismatchError:
            return False
        return True

    def begin(self, name: str, record: FileRecord, entry: dict[str, Any], resuming: bool) -> None:
        """Open (or, ``resuming``, re-open) the transfer of one file."""

    def confirm_pieces(self, name: str, record: FileRecord, pieces: list[Piece], claimed: dict[int, str],
                       local: LocalPiece) -> dict[int, str]:
        """Of the pieces the journal ``claimed`` (index: tag), those the target provably holds."""
        return {}

    def put_piece(self, name: str, piece: Piece, data: bytes | bytearray, entry: dict[str, Any],
                  record: FileRecord | None = None) -> str:
        """Send one piece, durably; returns a tag the journal keeps (an ETag on S3). ``record``
        (the piece's blocks, already checked against ``data``) spares a target that wants a
        checksum hashing the bytes again."""
        raise NotImplementedError

    def buffer(self, length: int) -> bytearray | None:
        """A buffer of ``length`` bytes this thread may read its next piece into (reused once
        the piece is sent), or None: the source allocates."""
        return None

    def finish(self, name: str, pieces: list[Piece], tags: dict[int, str], entry: dict[str, Any]) -> None:
        """Every piece is in: make the file visible under its name."""

    def discard(self, name: str, entry: dict[str, Any]) -> None:
        """Drop the unfinished transfer of ``name`` (partial file, pending upload)."""

    def abandon(self) -> None:
        """After a failed attempt: release open transfers without publishing anything."""

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self.store.read_range(name, start, end)

    def read_small(self, name: str) -> bytes:
        return self.store.read(name)

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
        self.local_root = root

    def _partial_name(self, name: str) -> str:
        return f".{name}.drain-partial"

    def _partial(self, name: str) -> str:
        return os.path.join(self.root, self._partial_name(name))

    def begin(self, name: str, record: FileRecord, entry: dict[str, Any], resuming: bool) -> None:
        # the partial file is ours: a link planted under its name is removed and the file made
        # fresh (the pieces the journal claims then fail their read-back and are sent again)
        partial = self._partial(name)
        fd = create_no_follow(partial, os.O_WRONLY, fresh=not resuming or os.path.islink(partial))
        try:
            os.ftruncate(fd, record.size)  # a longer leftover is cut; a hole never passes a checksum
        finally:
            os.close(fd)

    def confirm_pieces(self, name: str, record: FileRecord, pieces: list[Piece], claimed: dict[int, str],
                       local: LocalPiece) -> dict[int, str]:
        partial = self._partial_name(name)
        return {i: tag for i, tag in claimed.items() if self._read_back_ok(name, record, pieces[i], partial)}

    def put_piece(self, name: str, piece: Piece, data: bytes | bytearray, entry: dict[str, Any],
                  record: FileRecord | None = None) -> str:
        fd = create_no_follow(self._partial(name), os.O_WRONLY)  # a link planted since begin: refused
        try:
            pwrite_all(fd, memoryview(data), piece.offset)
            os.fsync(fd)  # durable before the journal says so
        finally:
            os.close(fd)
        return ""

    def finish(self, name: str, pieces: list[Piece], tags: dict[int, str], entry: dict[str, Any]) -> None:
        os.replace(self._partial(name), os.path.join(self.root, name))
        fsync_dir(self.root)

    def discard(self, name: str, entry: dict[str, Any]) -> None:
        try:
            os.unlink(self._partial(name))
        except FileNotFoundError:
            pass

    def put_small(self, name: str, data: bytes) -> None:
        """Temp, fsync, rename, fsync dir; a failed write (ENOSPC) leaves no temp file behind."""
        final = os.path.join(self.root, name)
        temp = os.path.join(self.root, f".{name}.drain-tmp-{os.getpid()}")
        try:
            write_file_fresh(temp, data)  # a link planted under the temp name is removed, never followed
            os.replace(temp, final)
        except BaseException:
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass
            raise
        fsync_dir(self.root)


class S3Sink(Sink):
    min_part = S3_MIN_PART
    max_parts = S3_MAX_PARTS

    def __init__(self, target: str, fs) -> None:
        super().__init__(target, FsspecStore(target, fs=fs))
        self.fs = fs
        self._listed: dict[str, dict[int, dict[str, Any]]] = {}

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

    def confirm_file(self, name: str, record: FileRecord, pieces: list[Piece], local: LocalPiece) -> bool:
        """Fast path: the object's multipart ETag is the md5 of the local pieces' md5s (no GET).
        Otherwise (another part size, a server whose ETags are not md5s): read back and check."""
        self.fs.invalidate_cache(self.store.path(name))
        try:
            info = self.fs.info(self.store.path(name))
        except FileNotFoundError:
            return False
        if int(info.get("size", -1)) != record.size:
            return False
        etag = str(info.get("ETag", "")).strip('"')
        if etag.endswith(f"-{len(pieces)}"):
            md5s = [hashlib.md5(local(record, p)).hexdigest() for p in pieces]
            if multipart_etag(md5s) == etag:
                return True
        return all(self._read_back_ok(name, record, piece, name) for piece in pieces)

    def begin(self, name: str, record: FileRecord, entry: dict[str, Any], resuming: bool) -> None:
        bucket, key = self._key(name)
        upload = entry.get("upload_id")
        self._listed[name] = {}
        if isinstance(upload, str) and upload:
            try:
                listed = self._list_parts(bucket, key, upload)
            except FileNotFoundError:  # NoSuchUpload: aborted, expired, completed, or the server lost it
                listed = None
            if listed is not None:
                self._listed[name] = listed
                return
        entry["upload_id"] = self._call("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]

    def _list_parts(self, bucket: str, key: str, upload: str) -> dict[int, dict[str, Any]]:
        parts: dict[int, dict[str, Any]] = {}
        page: dict[str, Any] = {}
        while True:
            answer = self._call("list_parts", Bucket=bucket, Key=key, UploadId=upload, **page)
            for part in answer.get("Parts", []):
                parts[int(part["PartNumber"])] = part
            if not answer.get("IsTruncated"):
                return parts
            page = next_parts_page(answer, page, f"s3://{bucket}/{key}", upload)

    def confirm_pieces(self, name: str, record: FileRecord, pieces: list[Piece], claimed: dict[int, str],
                       local: LocalPiece) -> dict[int, str]:
        listed = self._listed.get(name, {})
        confirmed = {}
        for index, tag in claimed.items():
            part = listed.get(index + 1)
            if part is None or int(part.get("Size", -1)) != pieces[index].length or part.get("ETag") != tag:
                continue
            if tag.strip('"') == hashlib.md5(local(record, pieces[index])).hexdigest():
                confirmed[index] = tag  # the server holds exactly the local piece's bytes
        return confirmed

    def put_piece(self, name: str, piece: Piece, data: bytes | bytearray, entry: dict[str, Any],
                  record: FileRecord | None = None) -> str:
        bucket, key = self._key(name)
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()  # the server checks what it got
        answer = self._call("upload_part", Bucket=bucket, Key=key, UploadId=entry["upload_id"],
                            PartNumber=piece.index + 1, Body=data, ContentMD5=md5)
        return answer["ETag"]

    def finish(self, name: str, pieces: list[Piece], tags: dict[int, str], entry: dict[str, Any]) -> None:
        bucket, key = self._key(name)
        parts = [{"PartNumber": p.index + 1, "ETag": tags[p.index]} for p in pieces]
        try:
            self._call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=entry["upload_id"],
                       MultipartUpload={"Parts": parts})
        except FileNotFoundError:
            # Completed by an earlier run that died before its journal said so? The object's
            # multipart ETag (md5 of the part md5s) proves it is exactly these parts.
            if not self._has_etag(name, multipart_etag([tags[p.index] for p in pieces])):
                raise
        entry.pop("upload_id", None)
        self.fs.invalidate_cache(self.store.path(name))

    def discard(self, name: str, entry: dict[str, Any]) -> None:
        upload = entry.pop("upload_id", None)
        if upload:
            bucket, key = self._key(name)
            try:
                self._call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            except FileNotFoundError:
                pass

    def _has_etag(self, name: str, etag: str) -> bool:
        self.fs.invalidate_cache(self.store.path(name))
        try:
            return self.fs.info(self.store.path(name)).get("ETag", "").strip('"') == etag
        except FileNotFoundError:
            return False


def multipart_etag(part_etags: list[str]) -> str:
    digest = hashlib.md5(b"".join(bytes.fromhex(e.strip('"')) for e in part_etags))
    return f"{digest.hexdigest()}-{len(part_etags)}"


class BotoS3Sink(Sink):
    """S3 through botocore (see the module's docstring). A journal tag is ``ETAG|CRC``: the
    part's ETag (CompleteMultipartUpload names it) and its crc32c as S3 writes it."""

    min_part = S3_MIN_PART
    max_parts = S3_MAX_PARTS

    def __init__(self, target: str, store: S3Store) -> None:
        super().__init__(target, store)
        self.s3 = store
        self._listed: dict[str, dict[int, dict[str, Any]]] = {}
        self._buffers = threading.local()

    def buffer(self, length: int) -> bytearray | None:
        # one per thread, the size of its last piece (most pieces have the part size): the
        # memory stays what the pieces in flight need; botocore takes no view of a larger one
        held: bytearray | None = getattr(self._buffers, "held", None)
        if held is None or len(held) != length:
            held = self._buffers.held = bytearray(length)
        return held

    def _crc(self, record: FileRecord, piece: Piece, data: bytes | bytearray | None, local: LocalPiece | None) -> int:
        """The piece's crc32c from the blocks table (its checks tile it), else hashed."""
        crc = span_crc(checks_within(record, piece.offset, piece.offset + piece.length), piece.length)
        if crc is not None:
            return crc
        if data is None:
            assert local is not None
            data = local(record, piece)
        return crc32c.crc32c(data)

    def _composite(self, record: FileRecord, pieces: list[Piece], local: LocalPiece) -> set[str]:
        """The object checksums S3 may report for exactly these pieces: the composite (crc32c of
        the parts' crcs, ``-N``) and the whole object's crc32c."""
        crcs = [self._crc(record, p, None, local) for p in pieces]
        whole = crcs[0]
        for piece, crc in zip(pieces[1:], crcs[1:]):
            whole = crc32c_combine(whole, crc, piece.length)
        raw = b"".join(c.to_bytes(4, "big") for c in crcs)
        return {f"{b64_crc(crc32c.crc32c(raw))}-{len(pieces)}", b64_crc(whole)}

    def prepare(self) -> None:
        try:
            self.s3.call("head_bucket", f"s3://{self.s3.bucket}")
        except FileNotFoundError as exc:
            raise BucketMissingError(f"bucket {self.s3.bucket!r} does not exist ({exc}); create it or fix "
                                     "the target URL") from exc

    def confirm_file(self, name: str, record: FileRecord, pieces: list[Piece], local: LocalPiece) -> bool:
        """Fast: the object's crc32c (composite or whole) is the one of the local blocks (no
        read at all), or its multipart ETag is the md5 of the local pieces'; else read back."""
        try:
            info = self.s3.head(name)
        except FileNotFoundError:
            return False
        if int(info.get("ContentLength", -1)) != record.size:
            return False
        checksum = info.get("ChecksumCRC32C")
        if checksum and checksum in self._composite(record, pieces, local):
            return True
        etag = str(info.get("ETag", "")).strip('"')
        if etag.endswith(f"-{len(pieces)}") and multipart_etag(
                [hashlib.md5(local(record, p)).hexdigest() for p in pieces]) == etag:
            return True
        return all(self._read_back_ok(name, record, piece, name) for piece in pieces)

    def begin(self, name: str, record: FileRecord, entry: dict[str, Any], resuming: bool) -> None:
        upload = entry.get("upload_id")
        self._listed[name] = {}
        if isinstance(upload, str) and upload:
            try:
                self._listed[name] = self._list_parts(name, upload)
                return
            except FileNotFoundError:  # NoSuchUpload: aborted, expired, completed, or the server lost it
                pass
        entry["upload_id"] = self.s3.call("create_multipart_upload", self.location(name), Key=self.s3.key(name),
                                          ChecksumAlgorithm="CRC32C")["UploadId"]

    def _list_parts(self, name: str, upload: str) -> dict[int, dict[str, Any]]:
        parts: dict[int, dict[str, Any]] = {}
        page: dict[str, Any] = {}
        while True:
            answer = self.s3.call("list_parts", self.location(name), Key=self.s3.key(name), UploadId=upload, **page)
            for part in answer.get("Parts", []):
                parts[int(part["PartNumber"])] = part
            if not answer.get("IsTruncated"):
                return parts
            page = next_parts_page(answer, page, self.location(name), upload)

    def confirm_pieces(self, name: str, record: FileRecord, pieces: list[Piece], claimed: dict[int, str],
                       local: LocalPiece) -> dict[int, str]:
        """A journaled part counts only when the server lists it with the piece's size and
        either the crc32c of the local blocks or (a server that keeps no checksums) the md5
        of the local piece as its ETag."""
        listed = self._listed.get(name, {})
        confirmed = {}
        for index, tag in claimed.items():
            part, piece = listed.get(index + 1), pieces[index]
            etag = tag.split("|", 1)[0]
            if part is None or int(part.get("Size", -1)) != piece.length or part.get("ETag") != etag:
                continue
            checksum = part.get("ChecksumCRC32C")
            if checksum:
                vouched = checksum == b64_crc(self._crc(record, piece, None, local))
            else:
                vouched = etag.strip('"') == hashlib.md5(local(record, piece)).hexdigest()
            if vouched:
                confirmed[index] = f"{etag}|{checksum or ''}"
        return confirmed

    def put_piece(self, name: str, piece: Piece, data: bytes | bytearray, entry: dict[str, Any],
                  record: FileRecord | None = None) -> str:
        crc = b64_crc(self._crc(record, piece, data, None) if record is not None else crc32c.crc32c(data))
        answer = self.s3.call("upload_part", f"{self.location(name)} part {piece.index + 1}", Key=self.s3.key(name),
                              UploadId=entry["upload_id"], PartNumber=piece.index + 1, Body=data,
                              ChecksumCRC32C=crc)
        echoed = answer.get("ChecksumCRC32C")
        if echoed and echoed != crc:  # the server stored other bytes than the blocks' (never journaled)
            raise IncompleteOnTarget(f"{self.location(name)} part {piece.index + 1}: the server reports crc32c "
                                     f"{echoed}, the local blocks {crc}; sent again")
        return f"{answer['ETag']}|{crc}"

    def finish(self, name: str, pieces: list[Piece], tags: dict[int, str], entry: dict[str, Any]) -> None:
        parts = []
        for p in pieces:
            etag, _, crc = tags[p.index].partition("|")
            parts.append({"PartNumber": p.index + 1, "ETag": etag, **({"ChecksumCRC32C": crc} if crc else {})})
        try:
            self.s3.call("complete_multipart_upload", self.location(name), Key=self.s3.key(name),
                         UploadId=entry["upload_id"], MultipartUpload={"Parts": parts})
        except FileNotFoundError:
            # Completed by an earlier run that died before its journal said so? The object's
            # multipart ETag (md5 of the part ETags) proves it is exactly these parts.
            try:
                etag = str(self.s3.head(name).get("ETag", "")).strip('"')
            except FileNotFoundError:
                etag = ""
            if etag != multipart_etag([str(part["ETag"]) for part in parts]):
                raise
        entry.pop("upload_id", None)

    def discard(self, name: str, entry: dict[str, Any]) -> None:
        upload = entry.pop("upload_id", None)
        if upload:
            try:
                self.s3.call("abort_multipart_upload", self.location(name), Key=self.s3.key(name), UploadId=upload)
            except FileNotFoundError:
                pass


class StreamSink(Sink):
    ordered = True

    def __init__(self, target: str, fs) -> None:
        super().__init__(target, FsspecStore(target, fs=fs))
        self.fs = fs
        self.handles: dict[str, Any] = {}

    def begin(self, name: str, record: FileRecord, entry: dict[str, Any], resuming: bool) -> None:
        self.handles[name] = self.fs.open(self.store.path(name), "wb")  # no random access: resent whole

    def put_piece(self, name: str, piece: Piece, data: bytes | bytearray, entry: dict[str, Any],
                  record: FileRecord | None = None) -> str:
        self.handles[name].write(data)
        return ""

    def finish(self, name: str, pieces: list[Piece], tags: dict[int, str], entry: dict[str, Any]) -> None:
        self.handles.pop(name).close()

    def abandon(self) -> None:
        while self.handles:
            _, handle = self.handles.popitem()
            discard = getattr(handle, "discard", None)  # buffered fsspec files: drop, never publish
            if discard is not None:
                discard()


def open_sink(target: str, storage_options: dict[str, Any] | None = None, filesystem_=None) -> Sink:
    """The sink for a target URL or path; ``filesystem_`` overrides building one from options
    (an s3fs filesystem's own options choose the botocore path as storage options would)."""
    if not is_remote_url(target) and filesystem_ is None:
        return LocalSink(target)
    protocols = () if filesystem_ is None else filesystem_.protocol
    if target.startswith("s3://") and (filesystem_ is None or "s3" in protocols):
        options = storage_options if filesystem_ is None else getattr(filesystem_, "storage_options", None)
        store = object_store(target, options, filesystem_)
        if store is not None:
            return BotoS3Sink(target, store)
    fs = filesystem_ if filesystem_ is not None else filesystem(target, storage_options)[0]
    if is_local_fs(fs):
        return LocalSink(fs._strip_protocol(target))
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "s3" in protocol and hasattr(fs, "_call_s3"):
        return S3Sink(target, fs)
    return StreamSink(target, fs)
