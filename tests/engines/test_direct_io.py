"""O_DIRECT alignment from the kernel (statx STATX_DIOALIGN) or the device, and the engines
writing straight from memory that meets it (not only page-aligned memory)."""

from __future__ import annotations

import os

import pytest
import torch

from dcp_nvme.config import ALIGN, IOConfig
from dcp_nvme.engines.host_io import DEFAULT_DIO, _logical_block_size, _statx, aligned_buffer, dio_alignment
from dcp_nvme.engines.posix import PosixEngine
from dcp_nvme.engines.uring import UringEngine, uring_unavailable_reason
from dcp_nvme.format.container import ItemSpec, plan_container

ENGINES = [PosixEngine] + ([UringEngine] if uring_unavailable_reason() is None else [])


def test_dio_alignment_of_a_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        found = dio_alignment(fd)
        reported, block = _statx(fd), _logical_block_size(fd)
    finally:
        os.close(fd)
    assert found.memory & (found.memory - 1) == 0 and 0 < found.memory <= ALIGN
    assert found.offset & (found.offset - 1) == 0 and 0 < found.offset <= ALIGN
    if reported is not None and all(0 < n <= ALIGN for n in reported):
        assert (found.memory, found.offset, found.source) == (*reported, "statx")
    elif block is not None:
        assert (found.memory, found.offset, found.source) == (block, block, "logical_block_size")
    else:
        assert found == DEFAULT_DIO


def test_a_direct_span_meets_both_alignments():
    from dcp_nvme.engines.host_io import DioAlignment

    assert DioAlignment(4, 512, "statx").span == 512 and DioAlignment(4096, 512, "statx").span == 4096


def test_statx_refusal_falls_back(monkeypatch, tmp_path):
    import dcp_nvme.engines.host_io as dio

    monkeypatch.setattr(dio, "_statx", lambda fd: None)
    monkeypatch.setattr(dio, "_logical_block_size", lambda fd: None)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert dio.dio_alignment(fd) == DEFAULT_DIO
    finally:
        os.close(fd)


@pytest.mark.parametrize("engine_class", ENGINES)
def test_memory_aligned_to_the_device_not_the_page_is_written_in_place(tmp_path, engine_class):
    """A span starting at the device's memory alignment (here 512 bytes past a page) goes out
    with O_DIRECT from its own memory when the kernel says that is enough; bytes are exact."""
    config = IOConfig(queue_depth=2, block_size=65_536, direct_io=True)
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(ALIGN))
    fd = os.open(probe, os.O_RDONLY)
    try:
        memory = dio_alignment(fd).memory
    finally:
        os.close(fd)
    if memory >= ALIGN:
        pytest.skip(f"this filesystem asks for page-aligned memory ({memory}); nothing to show")
    nbytes = 4 * 65_536
    backing = aligned_buffer(nbytes + ALIGN, pin=False)
    source = backing[memory : memory + nbytes]  # aligned to the device, not to a page
    source.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    header = plan_container([ItemSpec("t", nbytes, "U8", (nbytes,))], {}).header
    engine = engine_class(config)
    try:
        written = engine.write_file(str(tmp_path / "c"), header, [source], 65_536)
    finally:
        engine.close()
    assert written.stats.direct_io and written.stats.copied_bytes == 0
    assert (tmp_path / "c").read_bytes()[len(header):] == bytes(source.numpy())
