"""Every I/O knob in one place: its default, its environment override, its tuned value.

Precedence, highest first: an explicit argument, an environment variable (only the few an
operator sets per cluster: ``known_env_names()``), the file written by ``dcp-nvme tune`` (read
only where ``DCP_NVME_TUNE_FILE`` points or where ``dcp-nvme tune`` wrote it by default), the
built-in default. The defaults (8 MiB requests, 8 in flight, O_DIRECT on) were chosen by fio
sweeps on the development machine: O_DIRECT sequential writes were flat across 1-16 MiB and 2-16
in flight, and well above buffered writes + fsync (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import os
import re
import stat
import time
from dataclasses import asdict, dataclass, field, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from dcp_nvme.errors import InvalidInputError, MissingDependencyError, UnknownOptionError
from dcp_nvme.humanize import format_size

log = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of the data region, of O_DIRECT buffers, offsets and lengths."""

MAX_CHECKSUM_BLOCK = 256 << 10
"""Checksums cover blocks of at most 256 KiB: a verified partial read costs at most 512 KiB
extra (1 MiB blocks made a resharded quarter-load read nearly twice the bytes it needed)."""

ENGINES = ("auto", "posix", "kvikio", "uring")
READ_MODES = ("auto", "direct", "buffered")
"""How containers are read: O_DIRECT, or the page cache with readahead (POSIX_FADV_SEQUENTIAL,
block_size preads); ``auto`` follows ``direct_io`` unless ``dcp-nvme tune`` stored a winner."""
HOST_ENGINES = ("posix", "uring")
"""What ``engine="auto"`` runs when there are no device tensors (``dcp-nvme tune`` measures both)."""
NODE_WRITE_ORDERS = ("together", "staggered")
"""How a node's ranks share the drive: all at once (each with its share of the node budget) or
one at a time (each with the whole budget, in turns); ``dcp-nvme tune --ranks`` measures both."""
COMPRESS_MODES = ("off", "auto", "bytegroup", "delta")
"""How the drain sends to a mirror (``tiers.compress``); the local checkpoint is always plain."""

ENV_PREFIX = "DCP_NVME_"
TUNE_FILE_ENV = "DCP_NVME_TUNE_FILE"


def default_tune_file() -> Path:
    """Where ``dcp-nvme tune`` writes its result and where writers and readers look for it."""
    if os.environ.get(TUNE_FILE_ENV):
        return Path(os.environ[TUNE_FILE_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dcp_nvme" / "tune.json"


MAX_DIGITS = 20
"""Digits of a number given as text: 2**64 has 20; more is a typo or an attack (int() of
thousands of digits is refused by Python itself, without naming the option)."""
MAX_SIZE_TEXT = 64
"""Characters of a size given as text, e.g. ``"1.5MiB"``."""

_SIZE_RE = re.compile(rf"^\s*([0-9]{{1,{MAX_DIGITS}}}(?:\.[0-9]{{1,{MAX_DIGITS}}})?)\s*([kmgt]?)(i?)(b?)\s*$",
                      re.IGNORECASE | re.ASCII)
_INT_RE = re.compile(rf"\s*[0-9]{{1,{MAX_DIGITS}}}\s*", re.ASCII)


def parse_size(value: int | str) -> int:
    """Bytes from ``8388608``, ``"8MiB"`` or ``"8M"`` (binary), or ``"5GB"`` (decimal).

    A whole number of bytes only: floats, booleans and fractional results are refused.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidInputError(f"not a size: {value!r} (use an integer number of bytes, or e.g. '8MiB' or '5GB')")
    if isinstance(value, int):
        if value < 0:
            raise InvalidInputError(f"not a size: {value!r} (negative)")
        return value
    match = _SIZE_RE.match(value) if len(value) <= MAX_SIZE_TEXT else None
    if not match:
        raise InvalidInputError(f"not a size: {_shown(value)} (use ASCII digits, e.g. 8388608, '8MiB' or '5GB')")
    number, unit, binary, byte = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    decimal = bool(unit) and bool(byte) and not binary
    exact = Fraction(number) * (1000 if decimal else 1024) ** power
    if exact.denominator != 1:
        raise InvalidInputError(f"not a size: {value!r} is not a whole number of bytes")
    return int(exact)


# --------------------------------------------------------------------------- validation
# Every option of NVMeWriter / NVMeReader / IOConfig is checked here, wherever it came from.

BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
              "0": False, "false": False, "no": False, "off": False}

QUEUE_DEPTH_RANGE = (1, 256)
BLOCK_SIZE_RANGE = (ALIGN, 256 << 20)
"""Requests of 4 KiB to 256 MiB, a multiple of 4 KiB: queue_depth of them are the bounce
buffers of a rank, so the largest block times the deepest queue is already 64 GiB."""
MEMORY_BUDGET_RANGE = (1 << 20, 1 << 40)
STAGING_BYTES_RANGE = (0, 1 << 50)
NODE_QUEUE_DEPTH_RANGE = (1, 65536)
"""A node's shared budget: an NVMe queue holds at most 64 Ki entries, more is a typo."""
REPLICAS_RANGE = (0, 16)
"""Copies of a node's files on other nodes' disks; more than a few only costs network."""
BANDWIDTH_RANGE = (1 << 10, 1 << 44)


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut short: a message names a value, it does not echo kilobytes of it."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python converts to text
        return f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _invalid(name: str, value: Any, source: str, problem: str) -> InvalidInputError:
    return InvalidInputError(f"{name}={_shown(value)} from {source} is not valid: {problem}")


def check_bool(name: str, value: Any, source: str = "the argument") -> bool:
    """A bool, or one of the words true/false, 1/0, yes/no, on/off (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
        return BOOL_WORDS[value.strip().lower()]
    raise _invalid(name, value, source, "expected True/False or one of true/false, 1/0, yes/no, on/off")


def check_int(name: str, value: Any, bounds: tuple[int, int], source: str = "the argument") -> int:
    """An integer (or a string of at most ``MAX_DIGITS`` ASCII digits) within ``bounds``, inclusive."""
    lo, hi = bounds
    number = value
    if isinstance(value, str) and _INT_RE.fullmatch(value):
        number = int(value)
    if isinstance(number, bool) or not isinstance(number, int):
        raise _invalid(name, value, source, f"expected an integer from {lo} to {hi} "
                                            f"(at most {MAX_DIGITS} ASCII digits)")
    if not lo <= number <= hi:
        raise _invalid(name, value, source, f"must be from {lo} to {hi}")
    return number


def check_size(name: str, value: Any, bounds: tuple[int, int], source: str = "the argument",
               multiple: int = 1) -> int:
    """Bytes: an integer or a string like ``"8MiB"``, within ``bounds`` and a multiple of ``multiple``."""
    lo, hi = bounds
    try:
        number = parse_size(value)
    except ValueError as exc:
        raise _invalid(name, value, source, str(exc)) from None
    if not lo <= number <= hi:
        raise _invalid(name, value, source, f"must be from {format_size(lo)} to {format_size(hi)}")
    if number % multiple:
        raise _invalid(name, value, source, f"must be a multiple of {format_size(multiple)}{_binary_hint(value)}")
    return number


def _binary_hint(value: Any) -> str:
    """``did you mean '8MiB'?`` for a decimal size such as ``"8MB"``, which is rarely meant."""
    match = _SIZE_RE.match(value) if isinstance(value, str) and len(value) <= MAX_SIZE_TEXT else None
    if not match or not match.group(2) or match.group(3) or not match.group(4):
        return ""
    number, unit = match.group(1), match.group(2)
    return f" ({value.strip()!r} is decimal: {parse_size(value)} bytes); did you mean '{number}{unit.upper()}iB'?"


def check_choice(name: str, value: Any, choices: tuple[str, ...], source: str = "the argument") -> str:
    if not isinstance(value, str) or value not in choices:
        raise _invalid(name, value, source, f"expected one of {', '.join(choices)}")
    return value


EXTRAS = {"s3": "s3", "s3a": "s3"}
"""URL protocols whose fsspec backend one of our extras installs (``pip install 'dcp_nvme[s3]'``)."""


def missing_backend(protocol: str, url: str, detail: str = "") -> MissingDependencyError:
    """The error for a URL whose fsspec backend is not installed, naming what to install."""
    extra = EXTRAS.get(protocol)
    fix = f"pip install 'dcp_nvme[{extra}]'" if extra else (detail or f"install fsspec's backend for {protocol}://")
    return MissingDependencyError(f"{url}: {protocol}:// URLs need a package that is not installed: {fix}")


def check_backend(protocol: str, url: str) -> None:
    """``protocol``'s fsspec implementation can be imported (looked up, not imported: s3fs
    costs a second)."""
    import importlib.util

    from fsspec.registry import known_implementations, registry

    known = known_implementations.get(protocol)
    if protocol in registry or not known:
        return
    module = known["class"].split(".", 1)[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise missing_backend(protocol, url, known.get("err", ""))


def check_url(name: str, value: Any, source: str = "the argument") -> str:
    """A directory or an fsspec URL whose protocol fsspec knows (checked now, not at first use)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise _invalid(name, value, source, "expected a directory or an fsspec URL such as s3://bucket/path")
    if "://" in value:
        protocol = value.split("://", 1)[0]
        import fsspec  # not at import time: ``dcp-nvme --help`` stays light

        if protocol not in fsspec.available_protocols():
            raise _invalid(name, value, source, f"fsspec knows no protocol {protocol!r}")
        check_backend(protocol, value)
    return value


def parse_storage_options(text: str | None, source: str = "--storage-options") -> dict[str, Any] | None:
    """fsspec storage options given as JSON text (a command line's ``--storage-options``): a JSON
    object (its keys are strings), or None when not given. Anything else is refused naming
    ``source`` and the form expected, never echoing the text (it may hold a secret)."""
    if text is None or not text.strip():
        return None
    example = 'e.g. \'{"endpoint_url": "http://host:8333"}\''
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidInputError(f"{source} is not valid JSON ({exc}): give a JSON object, "
                                f"{example}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidInputError(f"{source} is a JSON {type(value).__name__}, not an object of "
                                f"option names to values: {example}")
    return value


_CREDENTIAL = re.compile(r"key|secret|token|passw|credential|auth|session|signature|cert", re.IGNORECASE)
"""Storage option names that may hold a credential (matched anywhere in the name)."""


def without_credentials(options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` with every entry whose name may hold a credential dropped, at any depth (e.g.
    ``client_kwargs.aws_secret_access_key``), and every value JSON cannot hold (a client object):
    what may be written to disk (a drain journal)."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if not isinstance(name, str) or _CREDENTIAL.search(name):
            continue
        if isinstance(value, dict):
            out[name] = without_credentials(value)
        elif _plain(value):
            out[name] = value
    return out


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(_plain(v) for v in value)


_OUTSIDE_CHECKS: dict[str, Any] = {
    "overwrite": check_bool,
    "allow_pickle": check_bool,
    "memory_budget": lambda n, v, s: check_size(n, v, MEMORY_BUDGET_RANGE, s),
    "max_bytes": lambda n, v, s: check_size(n, v, STAGING_BYTES_RANGE, s),
    "mirror": check_url,
    "mirror_root": check_url,
    "replicas": lambda n, v, s: check_int(n, v, REPLICAS_RANGE, s),
    "replica_stride": lambda n, v, s: check_int(n, v, NODE_QUEUE_DEPTH_RANGE, s),
    "replica_bandwidth": lambda n, v, s: None if v is None else check_size(n, v, BANDWIDTH_RANGE, s),
    "peers": check_bool,
}
"""The checks of the writer's and reader's options outside IOConfig (IOConfig's fields carry theirs)."""


def check_option(name: str, value: Any, source: str = "the argument") -> Any:
    """``value`` of option ``name`` in its canonical form, or InvalidInputError naming option, value and source."""
    return _CHECKS[name](name, value, source)


def _option(default: Any, check: Any, *, env: bool = False, tuned: bool = False, takes: tuple[str, ...] = (),
            trainer: tuple[Any, str] | None = None) -> Any:
    """An IOConfig field and everything about it: its default, its check (``check(name, value,
    source)``), whether an operator sets it as ``DCP_NVME_<FIELD>`` (``env``), whether
    ``dcp-nvme tune`` stores it (``tuned``), which of NVMeWriter and NVMeReader take it as a
    keyword (``takes``), and, for an option a trainer's config carries, its type there and its
    help (``trainer``). The tables below are read from these."""
    return field(default=default, metadata={"check": check, "env": env, "tuned": tuned, "takes": takes,
                                            "trainer": trainer})


@dataclass(frozen=True)
class IOConfig:
    """How a rank talks to its storage.

    ``queue_depth`` requests of ``block_size`` bytes are in flight per rank: that product is the
    write window. With N ranks on one node the device sees N x queue_depth requests, unless
    ``node_queue_depth`` is set: then the node's ranks share that many (``host.job``), all
    at once or, with ``node_write_order="staggered"``, one rank at a time.
    """

    queue_depth: int = _option(8, lambda n, v, s: check_int(n, v, QUEUE_DEPTH_RANGE, s), env=True, tuned=True,
                               takes=("writer", "reader"), trainer=(int, "requests in flight per rank"))
    block_size: int = _option(8 << 20, lambda n, v, s: check_size(n, v, BLOCK_SIZE_RANGE, s, multiple=ALIGN),
                              env=True, tuned=True, takes=("writer", "reader"),
                              trainer=(str, 'bytes per request, e.g. "8MiB"'))
    direct_io: bool = _option(True, check_bool, env=True, tuned=True, takes=("writer", "reader"),
                              trainer=(bool, "O_DIRECT where the filesystem allows it"))
    engine: str = _option("auto", lambda n, v, s: check_choice(n, v, ENGINES, s), env=True, takes=("writer", "reader"),
                          trainer=(Literal[ENGINES], "the I/O engine"))
    verify: bool = _option(True, check_bool, takes=("reader",),
                           trainer=(bool, "check the crc32c of every block loaded"))
    node_queue_depth: int | None = _option(
        None, lambda n, v, s: None if v is None else check_int(n, v, NODE_QUEUE_DEPTH_RANGE, s), env=True, tuned=True,
        takes=("writer",))
    read_mode: str = _option("auto", lambda n, v, s: check_choice(n, v, READ_MODES, s), tuned=True, takes=("reader",))
    host_engine: str = _option("posix", lambda n, v, s: check_choice(n, v, HOST_ENGINES, s), tuned=True)
    node_write_order: str = _option("together", lambda n, v, s: check_choice(n, v, NODE_WRITE_ORDERS, s),
                                    tuned=True, takes=("writer",))

    def __post_init__(self) -> None:
        for name in _FIELDS:  # frozen: store the canonical form (e.g. "8MiB" -> 8388608)
            object.__setattr__(self, name, check_option(name, getattr(self, name)))

    @property
    def checksum_block(self) -> int:
        """Checksum granularity: divides block_size, so every request covers whole blocks."""
        import math

        return math.gcd(self.block_size, MAX_CHECKSUM_BLOCK)

    @property
    def reads_direct(self) -> bool:
        """Whether reads use O_DIRECT: the read mode when set, else ``direct_io``."""
        return self.direct_io if self.read_mode == "auto" else self.read_mode == "direct"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_OPTIONS = fields(IOConfig)
_FIELDS = tuple(f.name for f in _OPTIONS)
_TUNED = tuple(f.name for f in _OPTIONS if f.metadata["tuned"])
"""The fields ``dcp-nvme tune`` stores, read from its file."""
_CHECKS: dict[str, Any] = {**{f.name: f.metadata["check"] for f in _OPTIONS}, **_OUTSIDE_CHECKS}
"""The one place each option's form and range is checked: name -> check(name, value, source)."""

WRITER_IO = tuple(f.name for f in _OPTIONS if "writer" in f.metadata["takes"])
READER_IO = tuple(f.name for f in _OPTIONS if "reader" in f.metadata["takes"])
"""The IOConfig fields NVMeWriter and NVMeReader take as keywords."""
SHARED_IO = tuple(name for name in WRITER_IO if name in READER_IO)
"""The I/O keywords of both, with one meaning and one environment variable."""


def _trainer_help(option: Any) -> str:
    """An option's help in a trainer's config, with where its value comes from when it is unset."""
    sources = ([ENV_PREFIX + option.name.upper()] if option.metadata["env"] else []) + \
        (["the dcp-nvme tune file"] if option.metadata["tuned"] else []) + ["the default"]
    return f"{option.metadata['trainer'][1]} (unset: {', '.join(sources)})"


IO_OPTIONS: dict[str, tuple[Any, str]] = {f.name: (f.metadata["trainer"][0], _trainer_help(f))
                                          for f in _OPTIONS if f.metadata["trainer"]}
"""The options a trainer's config carries (``integrations``): name -> (its type there, its help)."""


ENV_FIELDS = tuple(f.name for f in _OPTIONS if f.metadata["env"])
"""The IOConfig fields an operator sets per cluster, each also read as ``DCP_NVME_<FIELD>``; the
others (verify, read_mode, host_engine, node_write_order) come from an argument or the tune file."""

OUTSIDE_OPTIONS = ("replica_stride",)
"""The options outside IOConfig read through ``option_or_env``, each as ``DCP_NVME_<NAME>``
(how the nodes are racked: replicas go to nodes i+k*stride)."""

EXIT_WAIT_ENV = "DCP_NVME_EXIT_WAIT"
EXIT_WAIT_DEFAULT = 600
EXIT_WAIT_RANGE = (0, 7 * 24 * 3600)
"""Seconds a process that ends waits for its background drains (0: it does not wait)."""

OTHER_ENV = ("DCP_NVME_TUNE_FILE", EXIT_WAIT_ENV)
"""The other ``DCP_NVME_*`` variables read: where the tune file is, and how long the exit waits
for drains."""


def exit_wait(environ: Any = None) -> int:
    """Seconds the interpreter's exit waits for this process's drains: ``DCP_NVME_EXIT_WAIT``
    (whole seconds, 0 for no wait), else ``EXIT_WAIT_DEFAULT``."""
    raw = (os.environ if environ is None else environ).get(EXIT_WAIT_ENV)
    if raw is None or raw.strip() == "":
        return EXIT_WAIT_DEFAULT
    return check_int("exit_wait", raw, EXIT_WAIT_RANGE, f"environment variable {EXIT_WAIT_ENV}")

def known_env_names() -> tuple[str, ...]:
    """Every ``DCP_NVME_*`` variable dcp_nvme reads."""
    return tuple(ENV_PREFIX + name.upper() for name in (*ENV_FIELDS, *OUTSIDE_OPTIONS)) + OTHER_ENV


def closest(name: str, choices: Any, cutoff: float = 0.6) -> str | None:
    """The choice ``name`` is most likely a misspelling of, or None when none is close."""
    found = difflib.get_close_matches(name, list(choices), n=1, cutoff=cutoff)
    return found[0] if found else None


_WARNED_ENV: set[str] = set()


def warn_unknown_env(environ: Any = None) -> list[str]:
    """Warn (once per process and name) about each set ``DCP_NVME_*`` variable that no option
    reads: a misspelt one would otherwise be ignored without a word. Returns the warnings."""
    environ = os.environ if environ is None else environ
    known = known_env_names()
    said = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name in _WARNED_ENV:
            continue
        _WARNED_ENV.add(name)
        guess = closest(name, known)
        hint = f"did you mean {guess}?" if guess else f"the variables read are {', '.join(known)}"
        said.append(f"dcp_nvme: environment variable {name} is not a dcp_nvme setting and is ignored; {hint}")
        log.warning("%s", said[-1])
    return said


def _from_env() -> dict[str, Any]:
    warn_unknown_env()
    found: dict[str, Any] = {}
    for name in ENV_FIELDS:
        env_name = ENV_PREFIX + name.upper()
        raw = os.environ.get(env_name)
        if raw is None or raw == "":
            continue
        found[name] = check_option(name, raw, f"environment variable {env_name}")
    return found


MAX_TUNE_FILE = 1 << 20
"""A tune file is a few KiB of JSON; a larger one is not read."""


def _read_tune_file(path: Path) -> bytes | None:
    """The tune file's bytes, None when there is none; ValueError when it is not a regular
    file (opened without blocking, so a FIFO cannot hang) or over ``MAX_TUNE_FILE``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file (a FIFO, device or directory)")
        if info.st_size > MAX_TUNE_FILE:
            raise ValueError(f"it has {info.st_size} bytes, more than the {MAX_TUNE_FILE} a tune file may have")
        data = b""  # read bounded even if the file grows meanwhile: one byte over tells
        while len(data) <= MAX_TUNE_FILE and (chunk := os.read(fd, MAX_TUNE_FILE + 1 - len(data))):
            data += chunk
        return data
    finally:
        os.close(fd)


_TUNE_CACHE: dict[str, Any] = {}
"""The tune file last read: ``{"last": ((path, mtime, size, device, inode, ctime), values, read at)}``."""
TUNE_RACY_NS = 2 * 10**9
"""A tune file modified this close (ns) to when it was read is read again next time: a rewrite
of the same size within the filesystem's timestamp granularity would leave its key unchanged."""
_TUNE_LOGGED: set[tuple[str, tuple[tuple[str, Any], ...]]] = set()
"""(path, values) already named in the log: once per process, again only if the values change."""


def _from_tune_file() -> dict[str, Any]:
    """The checked values of the tune file, read once per process and version of the file (a
    writer or reader built per step does not re-read it); re-read when it changes."""
    path = default_tune_file()
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return {}
    except OSError:
        key = None  # unreadable: let the read below name why
    else:
        key = (str(path), info.st_mtime_ns, info.st_size, info.st_dev, info.st_ino, info.st_ctime_ns)
    last = _TUNE_CACHE.get("last")
    if key is not None and last is not None and last[0] == key \
            and max(info.st_mtime_ns, info.st_ctime_ns) < last[2] - TUNE_RACY_NS:
        return dict(last[1])
    read_at = time.time_ns()
    values = _read_tune_values(path)
    _TUNE_CACHE["last"] = (key, values, read_at)
    logged = (str(path), tuple(sorted(values.items())))
    if values and logged not in _TUNE_LOGGED:
        _TUNE_LOGGED.add(logged)
        shown = ", ".join(f"{k}={format_size(v).replace(' ', '') if k == 'block_size' else v}"
                          for k, v in values.items())
        log.info("dcp_nvme: using the settings `dcp-nvme tune` measured, from %s: %s (an argument or "
                 "DCP_NVME_* variable overrides each)", path, shown)
    return dict(values)


def _read_tune_values(path: Path) -> dict[str, Any]:
    try:
        data = _read_tune_file(path)
        if data is None:
            return {}
        if len(data) > MAX_TUNE_FILE:
            raise ValueError(f"it has more than the {MAX_TUNE_FILE} bytes a tune file may have")
        doc = json.loads(data)
        best = doc["best"]
        values = {k: best[k] for k in _TUNED if k in best}
    except RecursionError:
        log.warning("ignoring tune file %s: its JSON is nested too deeply (rerun `dcp-nvme tune`)", path)
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring tune file %s: %s (rerun `dcp-nvme tune`)", path, str(exc)[:300])
        return {}
    checked = {}
    for key, value in values.items():  # a value out of range is skipped, as a garbage file is
        try:
            checked[key] = check_option(key, value, f"tune file {path}")
        except InvalidInputError as exc:
            log.warning("ignoring %s of tune file %s: %s (rerun `dcp-nvme tune` or delete the file)",
                        key, path, str(exc)[:300])
    return checked


def resolve_config(**explicit: Any) -> IOConfig:
    """Build an IOConfig: explicit arguments (None means unset) > env > tune file > defaults.

    Every value is checked where it is read, so an error names its source: the argument, the
    environment variable, or the tune file.
    """
    unknown = set(explicit) - set(_FIELDS)
    if unknown:
        raise UnknownOptionError(f"unknown I/O option(s): {sorted(unknown)}")
    values: dict[str, Any] = {}
    values.update(_from_tune_file())
    values.update(_from_env())
    values.update({k: check_option(k, v) for k, v in explicit.items() if v is not None})
    return replace(IOConfig(), **values)


def option_or_default(name: str, value: Any, default: Any) -> Any:
    """An option outside IOConfig set by argument only (``replicas``, ``replica_bandwidth``,
    ``peers``): the argument, checked, else ``default``."""
    return default if value is None else check_option(name, value)


def option_or_env(name: str, value: Any, default: Any) -> Any:
    """An option outside IOConfig an operator sets per cluster (``replica_stride``): the argument,
    else ``DCP_NVME_<NAME>``, else ``default``; checked, and an error names its source."""
    if name not in OUTSIDE_OPTIONS:  # its variable must be known, or it is warned about as misspelt
        raise AssertionError(f"option_or_env({name!r}): add it to config.OUTSIDE_OPTIONS")
    if value is not None:
        return check_option(name, value)
    env_name = ENV_PREFIX + name.upper()
    raw = os.environ.get(env_name)
    if raw is None or raw.strip() == "":
        return default
    return check_option(name, raw, f"environment variable {env_name}")


# --------------------------------------------------------------------------- stock options
# What a FileSystemWriter/FileSystemReader argument means on our classes: shared by save/ and load/.

def options_of(cls: type[Any]) -> list[str]:
    """The keyword options of ``cls(...)``, as its signature names them."""
    return [p.name for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "path")]


def refuse_positional(cls: type, stock: str, names: tuple[str, ...], args: tuple[Any, ...]) -> None:
    """Options after the path are keyword-only: a stock positional call names what it meant."""
    if args:
        meant = ", ".join(f"{n}={v!r}" for n, v in zip(names, args)) or repr(args)
        raise UnknownOptionError(
            f"{cls.__name__} takes only the path positionally, got {len(args)} more argument(s) "
            f"({stock}'s positional order reads them as {meant}); pass options by keyword, e.g. "
            f"{cls.__name__}(path, overwrite=True)")


def unknown_option(cls: type, name: str, value: Any) -> UnknownOptionError:
    guess = closest(name, options_of(cls))
    hint = f"did you mean {guess}? " if guess else ""
    return UnknownOptionError(f"{cls.__name__} has no option {name}={value!r}; {hint}its options are "
                              f"{', '.join(options_of(cls))}")

