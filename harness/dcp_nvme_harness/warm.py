"""Python processes forked from a server that imported torch, DCP and dcp_nvme once.

A test that runs a script as a user would (``python script.py``, ``python -c CODE``, ``python -m
MOD``) pays the interpreter's start and torch's import in every run: some seconds of CPU each on
2 cores. ``WarmPython().run(argv, ...)`` runs it in a process forked from a server that paid
them once: the process is the script's own (its own pid, session, stdin/stdout/stderr, working
directory, environment, argv, ``__main__``), it exits as the interpreter does (non-daemon threads
joined, atexit handlers run, uncaught exceptions printed), and its exit status comes back.

What it cannot be is a process that imports less than the server did, or that reads an
environment variable at interpreter start (``PYTHONPATH``, ``-X`` options, torch's import-time
settings): a test of import costs, of import-time behaviour or of peak memory runs a real
interpreter instead.

    python = WarmPython()                # one server per test process (``warm_python()``)
    done = python.run(["-c", "print(1)"], cwd=tmp, env=env, timeout=60)   # a CompletedProcess
"""

from __future__ import annotations

import array
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

PRELOAD = ("torch", "torch.distributed.checkpoint", "dcp_nvme", "dcp_nvme.save.writer", "dcp_nvme.load.reader")
_MAX_HEADER = 1 << 20


class WarmPython:
    """One server (started on first use), forking a process per ``run``."""

    def __init__(self, preload: Sequence[str] = PRELOAD):
        self.preload = tuple(preload)
        self._server: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="warm-python-")
        self._socket = os.path.join(self._dir, "server")
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if self._server is not None and self._server.poll() is None:
                return
            self._server = subprocess.Popen([sys.executable, "-m", "dcp_nvme_harness.warm", self._socket, *self.preload],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
            assert self._server.stdout is not None
            line = self._server.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(f"the warm Python server did not start (said {line!r})")

    def run(self, args: Sequence[str | os.PathLike], *, cwd: str | os.PathLike | None = None,
            env: Mapping[str, str] | None = None, timeout: float = 120, input: str | None = None,
            ) -> subprocess.CompletedProcess:
        """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``, forked
        from the server; on timeout the process's session is killed and TimeoutExpired raised."""
        self._start()
        argv = [str(a) for a in args]
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        header = json.dumps({"argv": argv, "cwd": os.path.abspath(cwd or os.getcwd()),
                             "env": dict(os.environ if env is None else env)}).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._socket)
            conn.sendmsg([len(header).to_bytes(8, "little") + header],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [stdin_r, out_w, err_w]))])
        finally:
            for fd in (stdin_r, out_w, err_w):
                os.close(fd)
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        feeder = threading.Thread(target=_feed, args=(stdin_w, (input or "").encode()), daemon=True)
        feeder.start()
        reply = conn.makefile("rb")
        pid = int(reply.readline())
        deadline = time.monotonic() + timeout
        try:
            open_fds = [out_r, err_r]
            while open_fds:
                left = deadline - time.monotonic()
                if left <= 0:
                    _kill_session(pid)
                    raise subprocess.TimeoutExpired(argv, timeout, b"".join(chunks[out_r]), b"".join(chunks[err_r]))
                ready, _, _ = select.select(open_fds, [], [], min(left, 1.0))
                for fd in ready:
                    data = os.read(fd, 1 << 16)
                    if data:
                        chunks[fd].append(data)
                    else:
                        open_fds.remove(fd)
            status = json.loads(reply.readline())["status"]
        finally:
            reply.close()
            conn.close()
            os.close(out_r)
            os.close(err_r)
        return subprocess.CompletedProcess(argv, status, b"".join(chunks[out_r]).decode(errors="replace"),
                                           b"".join(chunks[err_r]).decode(errors="replace"))

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            os.killpg(self._server.pid, signal.SIGKILL)
            self._server.wait()
        self._server = None
        with _quiet():
            os.unlink(self._socket)
            os.rmdir(self._dir)


def _feed(fd: int, data: bytes) -> None:
    with _quiet(), os.fdopen(fd, "wb") as f:
        f.write(data)


def _kill_session(pid: int) -> None:
    with _quiet():
        os.killpg(pid, signal.SIGKILL)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is not None and issubclass(kind, OSError)


_shared: WarmPython | None = None


def warm_python() -> WarmPython:
    """This process's server (started on first use, ended at exit)."""
    global _shared
    if _shared is None:
        _shared = WarmPython()
        import atexit

        atexit.register(_shared.close)
    return _shared


# -- the server side. Nothing here cleans up on the way out: a forked process leaves it by raising
# SystemExit through these frames, and the interpreter's own exit must be the only thing that runs.


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancdata, _flags, _addr = conn.recvmsg(1 << 16, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    size = int.from_bytes(data[:8], "little")
    if not 0 < size <= _MAX_HEADER:
        raise ValueError(f"bad request header size {size}")
    body = data[8:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ValueError("request cut short")
        body += more
    return json.loads(body), list(fds)


def _become(request: dict, fds: list[int]) -> None:
    """In the forked process: take the request's stdio, directory, environment and argv, run it."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    argv = request["argv"]
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(argv[1], "<string>", "exec"), main)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    raise SystemExit(0)


def _wait_and_report(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked waiter: fork the process itself, report its pid and then its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become(request, fds)
    try:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        conn.sendall((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    except OSError:  # the caller gave up on it (a timeout): nobody to tell
        pass
    os._exit(0)


def serve(path: str, preload: Sequence[str]) -> None:
    import importlib

    for module in preload:
        importlib.import_module(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _wait_and_report(conn, request, fds)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
