"""A simulated node's server, forked from a zygote instead of started afresh.

``python -m dcp_nvme_harness.node_server SOCKET HOST DISK MOUNT HOSTS NETNS`` (run through a
``WarmPython`` that imported what the node's launches need: ``multinode.node_zygote()``) does
what ``unshare --mount --uts --pid --fork --kill-child --mount-proc`` and the node's shell do
for a fresh interpreter, without the interpreter: it joins the network namespace NETNS (a path,
or "" for the host's), takes a mount and a UTS namespace of its own (host name HOST; DISK bound
at MOUNT, a tmpfs at ``/dev/shm``, HOSTS at ``/etc/hosts`` unless ""), then forks the first
process of a new pid namespace, which serves SOCKET (``warm.serve``) with nothing left to import.

When this process dies (the cluster powers the node off), the kernel kills its child and, with
it, every process of the node's pid namespace.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import sys
import tempfile

from dcp_nvme_harness.warm import serve

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x20000000, 0x40000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                       data and data.encode()), f"mount {source} at {target}")


def boot(host: str, disk: str, mount: str, hosts: str, netns: str) -> None:
    """This process into the node's network, mount and UTS namespaces (the pid one is its children's)."""
    if netns:
        fd = os.open(netns, os.O_RDONLY)
        try:
            _check(_libc.setns(fd, _CLONE_NEWNET), f"setns {netns}")
        finally:
            os.close(fd)
    _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWUTS | _CLONE_NEWPID), "unshare")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    socket.sethostname(host)
    _mount(disk, mount, None, _MS_BIND)
    _mount("tmpfs", "/dev/shm", "tmpfs", 0, "mode=1777")
    if hosts:
        _mount(hosts, "/etc/hosts", None, _MS_BIND)
    tempfile.tempdir = None  # the zygote's may be cached; the node's TMPDIR is in the environment


def main(argv: list[str]) -> None:
    path, host, disk, mount, hosts, netns, *preload = argv
    boot(host, disk, mount, hosts, netns)
    alive_r, alive_w = os.pipe()  # at its end when this process has died
    pid = os.fork()
    if pid == 0:  # pid 1 of the node
        try:
            os.close(alive_w)
            _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL), "prctl")
            if select.select([alive_r], [], [], 0)[0]:  # it died before the line above
                os._exit(1)
            _mount(None, "/proc", None, _MS_REC | _MS_PRIVATE)
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
            serve(path, preload)  # the node's processes leave it by SystemExit, as from warm.serve
        except Exception as exc:
            print(f"node server {host}: {exc!r}", file=sys.stderr, flush=True)
            os._exit(1)
    os.waitpid(pid, 0)
    os._exit(1)  # a server ends only when killed


if __name__ == "__main__":
    main(sys.argv[1:])
