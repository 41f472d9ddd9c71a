"""S3 through botocore itself: the drain's multipart uploads and the restore's ranged GETs.

s3fs (aiobotocore under an event loop) costs more imports and more CPU per GB than plain
botocore on threads (docs/benchmarks.md, "S3 clients"). Where the target is
``s3://`` and its storage options say nothing botocore alone cannot honour, the mirror goes
through here; every other case (another protocol, an option only s3fs knows, no botocore) keeps
fsspec, and the fallback is said once.

The storage options (s3fs's names) are read and checked in one place, ``s3_options``. The
client signs no payload (each part carries its crc32c, which the server checks, and the drain
checked those bytes against the blocks table), computes no checksum of its own, and validates
none of the responses (the reader checks every block).
"""

from __future__ import annotations

import base64
import errno
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dcp_nvme.config import IOConfig, check_backend
from dcp_nvme.engines.requests import IOStats, ReadRequest, run_bounded
from dcp_nvme.errors import BucketMissingError, InvalidInputError, ManifestError
from dcp_nvme.host.files import bare_name
from dcp_nvme.storage.fsspec_dir import FsspecStore, filesystem

log = logging.getLogger(__name__)

POOL = 64
"""Connections per client: more than any drain's transfers or a reader's queue depth."""

_IGNORED = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                      "default_fill_cache", "default_cache_type", "default_block_size", "asynchronous",
                      "loop", "version_aware", "cache_regions"})
"""s3fs options that change nothing of what botocore sends (caches, its event loop)."""
_CONFIG_KEYS = frozenset({"retries", "connect_timeout", "read_timeout", "max_pool_connections"})


@dataclass(frozen=True)
class S3Options:
    """What a botocore client needs, from fsspec/s3fs storage options (checked)."""

    endpoint_url: str | None = None
    region: str | None = None
    key: str | None = None
    secret: str | None = None
    token: str | None = None
    max_attempts: int | None = None
    retry_mode: str | None = None
    connect_timeout: float | None = None
    read_timeout: float | None = None


def _text(options: dict[str, Any], name: str) -> str | None:
    value = options.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidInputError(f"storage_options[{name!r}] must be a string, got {type(value).__name__}")
    return value


def _number(options: dict[str, Any], name: str) -> float | None:
    value = options.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise InvalidInputError(f"storage_options config_kwargs[{name!r}] must be a positive number, got {value!r}")
    return value


def s3_options(storage_options: dict[str, Any] | None) -> tuple[S3Options | None, str]:
    """The client options, or None and why when only s3fs can honour ``storage_options``.
    Raises InvalidInputError for an option of the wrong type."""
    options = dict(storage_options or {})
    if options.pop("anon", False):
        return None, "anon=True (unsigned requests)"
    client = options.pop("client_kwargs", None) or {}
    config = options.pop("config_kwargs", None) or {}
    if not isinstance(client, dict) or not isinstance(config, dict):
        raise InvalidInputError("storage_options client_kwargs and config_kwargs must be dicts")
    endpoint = _text(options, "endpoint_url") or _text(client, "endpoint_url")
    other = set(options) - _IGNORED - {"key", "secret", "token", "endpoint_url"}
    other |= {f"client_kwargs.{k}" for k in set(client) - {"region_name", "endpoint_url"}}
    other |= {f"config_kwargs.{k}" for k in set(config) - _CONFIG_KEYS}
    if other:
        return None, f"storage option(s) {', '.join(sorted(other))}"
    retries = config.get("retries") or {}
    if not isinstance(retries, dict):
        raise InvalidInputError(f"storage_options config_kwargs['retries'] must be a dict, got {retries!r}")
    attempts = retries.get("max_attempts", retries.get("total_max_attempts"))
    if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 0):
        raise InvalidInputError(f"storage_options retries max_attempts must be an int >= 0, got {attempts!r}")
    mode = retries.get("mode")
    if mode is not None and mode not in ("legacy", "standard", "adaptive"):
        raise InvalidInputError(f"storage_options retries mode must be legacy, standard or adaptive, got {mode!r}")
    return S3Options(endpoint_url=endpoint, region=_text(client, "region_name"), key=_text(options, "key"),
                     secret=_text(options, "secret"), token=_text(options, "token"), max_attempts=attempts,
                     retry_mode=mode, connect_timeout=_number(config, "connect_timeout"),
                     read_timeout=_number(config, "read_timeout")), ""


_clients: dict[S3Options, Any] = {}
_lock = threading.Lock()
_said: set[str] = set()


def _say_once(why: str) -> None:
    with _lock:
        if why in _said:
            return
        _said.add(why)
    log.warning("dcp_nvme: S3 goes through s3fs (more CPU per GB, slower) because of %s", why)


def client(options: S3Options) -> Any:
    """One botocore client per set of options, shared by every thread (botocore clients are
    thread-safe; building one loads the S3 model, which is slow)."""
    with _lock:
        found = _clients.get(options)
        if found is not None:
            return found
        import botocore.session
        from botocore.config import Config

        retries = {k: v for k, v in (("max_attempts", options.max_attempts), ("mode", options.retry_mode))
                   if v is not None}
        timeouts = {k: v for k, v in (("connect_timeout", options.connect_timeout),
                                      ("read_timeout", options.read_timeout)) if v is not None}
        config = Config(max_pool_connections=POOL, retries=retries or {"mode": "standard"},
                        s3={"payload_signing_enabled": False, "addressing_style": "path"},
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required", **timeouts)
        made = botocore.session.get_session().create_client(
            "s3", region_name=options.region, endpoint_url=options.endpoint_url, aws_access_key_id=options.key,
            aws_secret_access_key=options.secret, aws_session_token=options.token, config=config)
        _clients[options] = made
        return made


def _code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    error = response.get("Error", {}) if isinstance(response, dict) else {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) if isinstance(response, dict) else 0
    return str(error.get("Code", "")), int(status or 0)


_MISSING = {"NoSuchKey", "NoSuchUpload", "NoSuchBucket", "NotFound", "404"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "AllAccessDisabled"}
_BUSY = {"SlowDown", "ServiceUnavailable", "503", "RequestLimitExceeded"}


def translate(exc: BaseException, where: str) -> BaseException:
    """botocore's ClientError as the OSError s3fs would raise (the drain's retry and cause rules
    are written for those); anything else unchanged."""
    code, status = _code(exc)
    if not code and not status:
        return exc
    text = f"{where}: {code or status}: {exc}"
    if code in _MISSING or status == 404:
        return BucketMissingError(text) if code == "NoSuchBucket" else FileNotFoundError(errno.ENOENT, text)
    if code in _DENIED or status == 403:
        return PermissionError(errno.EACCES, text)
    if code in _BUSY or status == 503:
        return OSError(errno.EBUSY, text)
    return exc


def b64_crc(crc: int) -> str:
    """S3's x-amz-checksum-crc32c: the big-endian crc, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class S3Store(FsspecStore):
    """A checkpoint prefix on S3 through botocore, with ``FsspecStore``'s methods. ``fs`` (an
    s3fs filesystem, for the few callers that need fsspec itself) is built on first use."""

    def __init__(self, url: str, options: S3Options, storage_options: dict[str, Any] | None,
                 fs: Any = None) -> None:
        self.url = url.rstrip("/")
        self.location = self.url
        self.root = self.url.split("://", 1)[1].rstrip("/")
        self.bucket = self.root.split("/", 1)[0]
        self.local = False
        self.client = client(options)
        self._fs, self._storage_options = fs, storage_options

    @property  # FsspecStore's is an attribute; this one is built lazily
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = filesystem(self.url, self._storage_options)[0]
        return self._fs

    def key(self, name: str) -> str:
        return self.path(name).split("/", 1)[1]

    def call(self, method: str, where: str, **kwargs: Any) -> dict[str, Any]:
        from botocore.exceptions import ClientError

        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            raise translate(exc, where) from exc

    def head(self, name: str) -> dict[str, Any]:
        return self.call("head_object", self.path(name), Key=self.key(name), ChecksumMode="ENABLED")

    def exists(self) -> bool:
        return bool(self.names())

    def has(self, name: str) -> bool:
        try:
            self.head(name)
        except FileNotFoundError:
            return False
        return True

    def names(self) -> list[str]:
        prefix = self.root.split("/", 1)[1] + "/" if "/" in self.root else ""
        found: list[str] = []
        token: dict[str, str] = {}
        while True:
            page = self.call("list_objects_v2", self.url, Prefix=prefix, Delimiter="/", **token)
            found += [item["Key"][len(prefix):] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(n for n in found if n and "/" not in n)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def size(self, name: str) -> int:
        return int(self.head(name)["ContentLength"])

    def read(self, name: str, max_size: int | None = None) -> bytes:
        size = self.size(name)
        if max_size is not None and size > max_size:
            raise ManifestError(f"{self.path(name)} is {size} bytes, more than the {max_size} a file of "
                                "its kind may have; the checkpoint is damaged or not a dcp_nvme checkpoint")
        return self.read_range(name, 0, size)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        buffer = bytearray(max(0, end - start))
        return bytes(buffer[: self.read_into(name, start, memoryview(buffer))])

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        """One ranged GET straight into ``buffer``; the bytes the object has there (fewer at its end)."""
        if not len(buffer):
            return 0
        where = f"{self.path(name)} bytes {offset}-{offset + len(buffer)}"
        try:
            answer = self.call("get_object", where, Key=self.key(name), Range=f"bytes={offset}-{offset + len(buffer) - 1}")
        except OSError:
            raise
        except Exception as exc:
            if _code(exc)[0] == "InvalidRange":  # at or past the end
                return 0
            raise
        body, filled = answer["Body"], 0
        try:
            raw = getattr(body, "_raw_stream", None)  # urllib3's response: reads into memory we own
            while filled < len(buffer):
                got = raw.readinto(buffer[filled:]) if raw is not None else 0
                if raw is None:
                    chunk = body.read(len(buffer) - filled)
                    got = len(chunk)
                    buffer[filled : filled + got] = chunk
                if not got:
                    break
                filled += got
        finally:
            body.close()
        return filled

    def make(self) -> None:
        pass  # an object store has no directories

    def write_atomic(self, name: str, data: bytes) -> None:
        """One PUT (readers see all or nothing), its crc32c checked by the server."""
        import crc32c

        self.call("put_object", self.path(name), Key=self.key(name), Body=bytes(data),
                  ChecksumCRC32C=b64_crc(crc32c.crc32c(data)))

    def remove(self, name: str) -> None:
        try:
            self.call("delete_object", self.path(name), Key=self.key(name))
        except FileNotFoundError:
            pass

    def sync(self) -> None:
        pass

    def read_engine(self, config: IOConfig) -> S3Engine:
        return S3Engine(self, config)


class S3Engine:
    """The engine protocol's read half over ``S3Store``: one ranged GET per request, ``queue_depth``
    in flight, each into a buffer its thread reuses, checked before any byte is delivered."""

    name = "s3"

    def __init__(self, store: S3Store, config: IOConfig) -> None:
        self.store, self.config = store, config
        self.local = threading.local()

    def write_file(self, path, header, sources, checksum_block):  # noqa: ANN001
        raise NotImplementedError("the S3 tier is written by the drain (dcp_nvme.tiers)")

    def _buffer(self, length: int) -> memoryview:
        held = getattr(self.local, "buffer", None)
        if held is None or len(held) < length:
            held = self.local.buffer = bytearray(length)
        return memoryview(held)[:length]

    def read(self, requests: Sequence[ReadRequest], dests: Sequence[Any]) -> IOStats:
        # engines.fsspec imports torch: a load has it, the CLI's listings that import the tiers must not
        from dcp_nvme.engines.fsspec import deliver

        stats = IOStats("read")
        started = time.perf_counter()
        prefix = self.store.root + "/"

        def run(request: ReadRequest) -> None:
            begun = stats.begin()
            buffer = self._buffer(request.length)
            name = request.file[len(prefix):] if request.file.startswith(prefix) else bare_name(request.file)
            got = self.store.read_into(name, request.file_offset, buffer)
            stats.end(begun, got, got)
            deliver(request, buffer[:got], dests)

        run_bounded(self.config.queue_depth, requests, run, "dcp-nvme-s3")
        stats.seconds = time.perf_counter() - started
        return stats

    def close(self) -> None:
        pass


def object_store(url: str, storage_options: dict[str, Any] | None, fs: Any = None) -> S3Store | None:
    """The botocore store of an ``s3://`` URL, or None (said once) where s3fs must serve it."""
    if not url.startswith("s3://") or len(url) <= len("s3://"):
        return None
    check_backend("s3", url)  # s3:// needs the s3 extra whichever client serves it (looked up, not imported)
    options, why = s3_options(storage_options)
    if options is None:
        _say_once(why)
        return None
    try:
        import botocore  # noqa: F401
    except ImportError:
        _say_once("botocore not installed")
        return None
    return S3Store(url, options, storage_options, fs)
