"""Engine choice and reuse, made at run time: POSIX everywhere, kvikio (cuFile) for device memory.

``auto`` picks kvikio only when CUDA is available, kvikio imports, a probe write and read of
device memory through kvikio succeeds in the target directory (cached per directory), and there
are device tensors to move; otherwise POSIX. ``engine="kvikio"`` where that chain breaks raises
``EngineUnavailableError`` naming the broken link. Nothing here imports kvikio at import time.

The third engine, ``fsspec.FsspecEngine`` (ranged GETs from any fsspec URL), serves readers of
remote checkpoints; it has no buffers to share, so it is made per read.

``shared_engine`` keeps one engine per process for each set of knobs engines read, so writers
and readers reuse its bounce buffers across saves and loads.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

from dcp_nvme.config import IOConfig
from dcp_nvme.engines.base import Engine, FileWriteResult
from dcp_nvme.errors import EngineUnavailableError
from dcp_nvme.lazy_imports import lazy_names

__all__ = [
    "Engine",
    "FileWriteResult",
    "PosixEngine",
    "kvikio_unavailable_reason",
    "select_engine",
    "shared_engine",
]

log = logging.getLogger(__name__)

# The engines import torch; ``dcp_nvme.engines.requests`` (the tools' thread runner) must not.
__getattr__, __dir__ = lazy_names(__name__, globals(), {"PosixEngine": ".posix"})


def _posix(config: IOConfig) -> Engine:
    """The cached threads engine for these knobs when there is one (none made to be thrown
    away by ``shared_engine``: a save of one request never calls into it, ``engines.small``)."""
    cached = _ENGINE_CACHE.get(_cache_key("posix", config))
    if cached is not None:
        return cached
    from dcp_nvme.engines.posix import PosixEngine

    return PosixEngine(config)

_probe_lock = threading.Lock()
_probes: dict[str, str | None] = {}  # directory -> why kvikio failed there (None: it works)
_logged: set[tuple[str, str]] = set()


def _probe_directory(directory: str | None) -> str:
    if directory and os.path.isdir(directory):
        return os.path.abspath(directory)
    return tempfile.gettempdir()


def kvikio_unavailable_reason(directory: str | None = None) -> str | None:
    """Why the kvikio engine cannot run here (for files in ``directory``), or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA: torch sees no GPU (no device, no driver, or a CPU-only torch build)"
    try:
        from dcp_nvme.engines.kvikio import import_kvikio

        import_kvikio()
    except ImportError as exc:
        return f"no kvikio: it is not installed ({exc}); pip install 'dcp_nvme[gds]'"
    except Exception as exc:  # noqa: BLE001 - e.g. libkvikio failing to load its libraries
        return f"kvikio failed to import: {type(exc).__name__}: {exc}"
    where = _probe_directory(directory)
    with _probe_lock:
        if where not in _probes:
            from dcp_nvme.engines.kvikio import probe

            _probes[where] = probe(where)
        return _probes[where]


def _kvikio_engine(config: IOConfig):
    from dcp_nvme.engines.kvikio import KvikioEngine, import_kvikio, kvikio_mode

    kvikio = import_kvikio()
    return KvikioEngine(config), f"kvikio {getattr(kvikio, '__version__', '?')}, {kvikio_mode(kvikio)} mode"


def _chosen(engine: Engine, reason: str) -> tuple[Engine, str]:
    key = (engine.name, reason)
    if key not in _logged:  # once per process and outcome, not once per save
        _logged.add(key)
        log.info("dcp_nvme: I/O engine %s (%s)", engine.name, reason)
    return engine, reason


def _uring_engine(config: IOConfig) -> tuple[Engine, str]:
    """io_uring when the kernel lets this process use it, else the threads engine, said loudly."""
    from dcp_nvme.engines.uring import UringEngine, uring_unavailable_reason

    reason = uring_unavailable_reason()
    if reason is None:
        return _chosen(UringEngine(config), "requested")
    why = f"requested uring, unavailable ({reason}): threads engine instead"
    if ("uring-fallback", reason) not in _logged:
        _logged.add(("uring-fallback", reason))
        log.warning("dcp_nvme: engine='uring' cannot run here: %s; using the threads engine (posix)",
                    reason)
    return _chosen(_posix(config), why)


def select_engine(
    config: IOConfig, has_device_tensors: bool, directory: str | None = None
) -> tuple[Engine, str]:
    """The engine for this pass, and the reason it was chosen (recorded in the manifest).

    ``directory`` is where the files are; the kvikio probe runs there (default: the temp dir).
    """
    if config.engine == "posix":
        return _chosen(_posix(config), "requested")
    if config.engine == "uring":
        return _uring_engine(config)
    if config.engine == "kvikio":
        reason = kvikio_unavailable_reason(directory)
        if reason:
            raise EngineUnavailableError(
                f"engine='kvikio' cannot run here: {reason}. Use engine='auto' or 'posix'."
            )
        engine, how = _kvikio_engine(config)
        return _chosen(engine, f"requested: {how}")
    if not has_device_tensors:
        if config.host_engine == "uring":  # what ``dcp-nvme tune`` measured better here
            engine, why = _uring_engine(config)
            return engine, f"auto: no device tensors, host_engine=uring; {why}"
        return _chosen(_posix(config), "auto: no device tensors")
    reason = kvikio_unavailable_reason(directory)
    if reason:
        return _chosen(_posix(config), f"auto: {reason}")
    engine, how = _kvikio_engine(config)
    return _chosen(engine, f"auto: device tensors, {how}")


def reset_probe_cache() -> None:
    """Forget the probe results (tests; or after installing a driver in a running process)."""
    with _probe_lock:
        _probes.clear()


ENGINE_KNOBS = ("queue_depth", "block_size", "direct_io", "read_mode")
"""The IOConfig fields an engine reads; anything else (verify, engine) must not split the cache."""

_ENGINE_CACHE: dict[tuple, Engine] = {}


def _cache_key(name: str, config: IOConfig) -> tuple:
    """One cached engine per kind and knobs."""
    return (name, *(getattr(config, knob) for knob in ENGINE_KNOBS))


_cache_lock = threading.Lock()


def shared_engine(
    config: IOConfig, has_device_tensors: bool, directory: str | None = None
) -> tuple[Engine, str]:
    """The engine ``select_engine`` picks, one per kind and knobs per process, so its buffers
    are reused across saves and loads (a ``verify=False`` reader shares the writer's).

    ``directory`` is where the files are: kvikio's probe runs there (once per directory)."""
    engine, reason = select_engine(config, has_device_tensors, directory)
    with _cache_lock:
        return _ENGINE_CACHE.setdefault(_cache_key(engine.name, config), engine), reason
