"""Listening ports for test servers that no other test process can be handed at the same time.

Binding to port 0 and closing races: the kernel may give the same ephemeral port to another
xdist worker's probe, or to any outgoing connection (gloo opens many), before our server binds it.
So ports come from below the kernel's ephemeral range, where the kernel never picks on its own,
and each one is claimed with an flock under the system temp directory that this process holds
until it exits (a test process uses a few hundred at most; the pool holds thousands).
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

_LOCKS = Path(tempfile.gettempdir()) / "dcp_nvme_test_ports"
_HELD: dict[int, int] = {}  # port -> descriptor of its lock file, kept open for the process's life


def _pool() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    if low - 1024 >= 4096:
        return range(max(1024, low - 12288), low)
    return range(high + 1, 65536)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore and moto bind
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port outside the ephemeral range that no other test process holds and that binds now."""
    _LOCKS.mkdir(exist_ok=True)
    pool = _pool()
    for _ in range(200):
        port = random.choice(pool)
        if port in _HELD:
            continue
        fd = os.open(_LOCKS / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _bindable(host, port):
            _HELD[port] = fd
            return port
        os.close(fd)
    raise RuntimeError(f"no free port in {pool.start}-{pool.stop - 1} after 200 tries")
