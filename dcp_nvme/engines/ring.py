"""A minimal io_uring ring over raw system calls (ctypes): setup, submit, reap, register buffers.

Why not the ``liburing`` package from PyPI: its 2026.3.30 wheel is built with AVX-512
instructions and dies with SIGILL in ``Ring()`` on CPUs without them (the development machine,
an AMD EPYC with AVX2 only), killing the whole process, which no fallback can catch. The kernel
interface is small and stable, so this module speaks it directly; nothing here is imported
unless ``engine="uring"`` is asked for.

Only x86_64 for now: the ring's head and tail are read and written with plain ctypes loads and
stores, which x86's total store order makes safe; a weakly ordered CPU (aarch64) would need
acquire/release barriers, so there the engine reports io_uring unavailable and falls back.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
from collections.abc import Sequence

SYS_SETUP, SYS_ENTER, SYS_REGISTER = 425, 426, 427
_MACHINES = ("x86_64",)

OP_NOP, OP_READV, OP_WRITEV, OP_READ_FIXED, OP_WRITE_FIXED, OP_READ, OP_WRITE = 0, 1, 2, 4, 5, 22, 23
_ENTER_GETEVENTS = 1
_REGISTER_BUFFERS, _UNREGISTER_BUFFERS = 0, 1
_FEAT_SINGLE_MMAP = 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_SQE_SIZE, _CQE_SIZE = 64, 16
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # opcode flags ioprio fd off addr len rw_flags user_data buf_index ...


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32), ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32), ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
        # io_sqring_offsets
        ("sq_head", ctypes.c_uint32), ("sq_tail", ctypes.c_uint32), ("sq_ring_mask", ctypes.c_uint32),
        ("sq_ring_entries", ctypes.c_uint32), ("sq_flags", ctypes.c_uint32),
        ("sq_dropped", ctypes.c_uint32), ("sq_array", ctypes.c_uint32), ("sq_resv1", ctypes.c_uint32),
        ("sq_user_addr", ctypes.c_uint64),
        # io_cqring_offsets
        ("cq_head", ctypes.c_uint32), ("cq_tail", ctypes.c_uint32), ("cq_ring_mask", ctypes.c_uint32),
        ("cq_ring_entries", ctypes.c_uint32), ("cq_overflow", ctypes.c_uint32),
        ("cq_cqes", ctypes.c_uint32), ("cq_flags", ctypes.c_uint32), ("cq_resv1", ctypes.c_uint32),
        ("cq_user_addr", ctypes.c_uint64),
    ]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def iovec_array(spans: Sequence[tuple[int, int]]) -> ctypes.Array:
    """``(address, length)`` spans as a ``struct iovec`` array, for OP_READV/OP_WRITEV (whose SQE
    takes its address and count); the caller keeps it alive until the transfer completes."""
    return (_Iovec * len(spans))(*[_Iovec(address, length) for address, length in spans])


_libc = None


def _syscall(*args: int | ctypes._CArgObject) -> int:  # _CArgObject: byref's type (stubs only)
    """A raw system call (the GIL is released while it runs); OSError on failure."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    while True:
        result = _libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
        if result >= 0:
            return result
        code = ctypes.get_errno()
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code))


class Ring:
    """One submission/completion queue pair of ``entries`` slots; used by one thread at a time."""

    def __init__(self, entries: int) -> None:
        if platform.system() != "Linux" or platform.machine() not in _MACHINES:
            raise OSError(errno.ENOSYS, "this io_uring ring supports Linux on x86_64 only")
        params = _Params()
        self.fd = _syscall(SYS_SETUP, entries, ctypes.byref(params))
        self._maps: list[mmap.mmap] = []
        try:
            self._map(params)
        except BaseException:
            self.close()
            raise
        self.registered = False

    def _map(self, p: _Params) -> None:
        sq_size = p.sq_array + p.sq_entries * 4
        cq_size = p.cq_cqes + p.cq_entries * _CQE_SIZE
        flags, prot = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ | mmap.PROT_WRITE
        if p.features & _FEAT_SINGLE_MMAP:
            sq = cq = mmap.mmap(self.fd, max(sq_size, cq_size), flags, prot, offset=_OFF_SQ_RING)
            self._maps.append(sq)
        else:
            sq = mmap.mmap(self.fd, sq_size, flags, prot, offset=_OFF_SQ_RING)
            cq = mmap.mmap(self.fd, cq_size, flags, prot, offset=_OFF_CQ_RING)
            self._maps += [sq, cq]
        self._sqes = mmap.mmap(self.fd, p.sq_entries * _SQE_SIZE, flags, prot, offset=_OFF_SQES)
        self._maps.append(self._sqes)
        u32 = ctypes.c_uint32
        self._sq_tail = u32.from_buffer(sq, p.sq_tail)
        self._sq_head = u32.from_buffer(sq, p.sq_head)
        self._sq_mask = u32.from_buffer(sq, p.sq_ring_mask).value
        self._sq_entries = p.sq_entries
        array = (u32 * p.sq_entries).from_buffer(sq, p.sq_array)
        for index in range(p.sq_entries):  # slot i always holds SQE i: we fill them in order
            array[index] = index
        self._cq_head = u32.from_buffer(cq, p.cq_head)
        self._cq_tail = u32.from_buffer(cq, p.cq_tail)
        self._cq_mask = u32.from_buffer(cq, p.cq_ring_mask).value
        self._cq = cq
        self._cqe_base = p.cq_cqes
        self._pending = 0  # prepared, not yet submitted

    @property
    def entries(self) -> int:
        return self._sq_entries

    def prepare(self, opcode: int, fd: int, address: int, length: int, offset: int,
                user_data: int, buf_index: int = 0) -> None:
        """Queue one read or write; it reaches the kernel at the next ``submit_and_wait``."""
        tail = self._sq_tail.value
        if tail - self._sq_head.value >= self._sq_entries:
            raise RuntimeError("io_uring submission queue full")
        index = tail & self._sq_mask
        _SQE.pack_into(self._sqes, index * _SQE_SIZE, opcode, 0, 0, fd, offset, address, length,
                       0, user_data, buf_index, 0, 0, 0, 0)
        self._sq_tail.value = tail + 1  # x86 keeps stores in order: the SQE is visible first
        self._pending += 1

    def submit_and_wait(self, wait_nr: int) -> list[tuple[int, int]]:
        """Submit what is queued, wait for at least ``wait_nr`` completions, return them all
        as ``(user_data, result)``; a negative result is ``-errno``."""
        submit, self._pending = self._pending, 0
        if submit or wait_nr:
            _syscall(SYS_ENTER, self.fd, submit, wait_nr, _ENTER_GETEVENTS if wait_nr else 0, 0, 0)
        done = []
        head, tail = self._cq_head.value, self._cq_tail.value
        while head != tail:
            user_data, result, _ = struct.unpack_from(
                "<QiI", self._cq, self._cqe_base + (head & self._cq_mask) * _CQE_SIZE)
            done.append((user_data, result))
            head = (head + 1) & 0xFFFFFFFF
            tail = self._cq_tail.value
        self._cq_head.value = head
        return done

    def register_buffers(self, spans: Sequence[tuple[int, int]]) -> None:
        """Register ``(address, length)`` spans as fixed buffers 0..n-1 (pinned once, not per I/O)."""
        iovecs = iovec_array(spans)
        _syscall(SYS_REGISTER, self.fd, _REGISTER_BUFFERS, ctypes.addressof(iovecs), len(spans))
        self.registered = True

    def close(self) -> None:
        if getattr(self, "fd", -1) < 0:
            return
        for name in ("_sq_tail", "_sq_head", "_cq_head", "_cq_tail"):  # views pin the maps
            self.__dict__.pop(name, None)
        for region in getattr(self, "_maps", []):
            try:
                region.close()
            except BufferError:
                pass
        os.close(self.fd)
        self.fd = -1


def unavailable_reason() -> str | None:
    """Why io_uring cannot be used in this process (None: a ring starts and a NOP completes)."""
    try:
        ring = Ring(2)
    except OSError as exc:
        hints: dict[int | None, str] = {
            errno.ENOSYS: "the kernel has no io_uring (needs Linux >= 5.1) or it is filtered",
            errno.EPERM: "io_uring is forbidden here (kernel.io_uring_disabled, seccomp, or a "
                         "container profile)"}
        hint = hints.get(exc.errno, "")
        return f"io_uring_setup failed: {exc.strerror}" + (f"; {hint}" if hint else "")
    try:
        ring.prepare(OP_NOP, -1, 0, 0, 0, 1)
        done = ring.submit_and_wait(1)
        if done != [(1, 0)]:
            return f"io_uring NOP returned {done!r}"
        return None
    except OSError as exc:
        return f"io_uring_enter failed: {exc.strerror}"
    finally:
        ring.close()
