"""Page-aligned host buffers: what O_DIRECT needs, pinned when CUDA is there to copy from."""

from __future__ import annotations

import mmap

import torch

from .config import ALIGN


def cuda_available() -> bool:
    """Asked at run time, never at import time."""
    return torch.cuda.is_available()


def aligned_buffer(nbytes: int, pin: bool | None = None) -> torch.Tensor:
    """A flat uint8 CPU tensor whose data starts on a page boundary, touched once.

    ``pin=None`` pins when CUDA is available, so device-to-host copies into it run at full speed.
    """
    nbytes = max(nbytes, 1)
    if pin is None:
        pin = cuda_available()
    if pin:
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if tensor.data_ptr() % ALIGN == 0:
            tensor.zero_()
            return tensor
    # anonymous mmap memory is page aligned and zero-filled; zero_() touches every page now so
    # the first save does not pay for page faults
    region = mmap.mmap(-1, nbytes)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    tensor.zero_()
    return tensor


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return tensor.reshape(-1).view(torch.uint8)
