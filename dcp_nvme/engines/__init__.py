"""Engine choice, made at run time: POSIX everywhere, kvikio (cuFile) for device memory."""

from __future__ import annotations

import logging

from ..config import IOConfig
from ..errors import EngineUnavailableError
from .base import Engine, FileWriteResult
from .posix import PosixEngine

__all__ = ["Engine", "FileWriteResult", "PosixEngine", "select_engine"]

log = logging.getLogger(__name__)


def kvikio_unavailable_reason() -> str | None:
    """Why the kvikio engine cannot run here, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available to torch (no GPU or no CUDA build)"
    try:
        import kvikio  # noqa: F401
    except ImportError as exc:
        return f"kvikio is not installed ({exc}); pip install 'dcp_nvme[gds]'"
    return None


def select_engine(config: IOConfig, has_device_tensors: bool) -> tuple[Engine, str]:
    """The engine for this pass, and the reason it was chosen (recorded in the manifest)."""
    if config.engine == "posix":
        return PosixEngine(config), "requested"
    if config.engine == "kvikio":
        reason = kvikio_unavailable_reason()
        if reason:
            raise EngineUnavailableError(f"engine='kvikio' cannot run here: {reason}")
        from .kvikio import KvikioEngine

        return KvikioEngine(config), "requested"
    if not has_device_tensors:
        return PosixEngine(config), "auto: no device tensors"
    reason = kvikio_unavailable_reason()
    if reason:
        return PosixEngine(config), f"auto: {reason}"
    from .kvikio import KvikioEngine

    return KvikioEngine(config), "auto: device tensors and kvikio available"
