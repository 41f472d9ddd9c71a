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
import contextlib
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
from collections.abc import Callable, Mapping, Sequence

PRELOAD = ("torch", "torch.distributed.checkpoint", "dcp_nvme", "dcp_nvme.save.writer", "dcp_nvme.load.reader")
_MAX_HEADER = 1 << 20


class WarmPython:
    """One server (started on first use), forking a process per ``run`` or ``start``.

    ``wrap`` puts the server somewhere else: ``wrap(argv)`` is the command line that runs
    ``argv`` there, ``socket_dir`` a directory both sides see. ``via`` forks the server from
    another server instead of starting an interpreter: ``-m via_module SOCKET *via_args
    *preload`` runs there, ends in ``serve`` and pays no import the other one paid (a simulated
    node's server: ``dcp_nvme_harness.node_server``).
    """

    def __init__(self, preload: Sequence[str] = PRELOAD, *, wrap: Callable[[list[str]], list[str]] | None = None,
                 socket_dir: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                 via: WarmPython | None = None, via_module: str = "", via_args: Sequence[str] = ()):
        self.preload = tuple(preload)
        self._via, self._via_argv = via, ["-m", via_module, *via_args]
        self._wrap = wrap or (lambda argv: argv)
        self._env = None if env is None else dict(env)
        self._server: subprocess.Popen | WarmProcess | None = None
        self._dir = tempfile.mkdtemp(prefix="warm-python-", dir=socket_dir)
        self._socket = os.path.join(self._dir, "server")
        if len(self._socket.encode()) > 100:  # AF_UNIX names end at 108 bytes
            raise ValueError(f"socket_dir {socket_dir} is too long a path for a socket; use a shorter one")
        self._lock = threading.Lock()

    @property
    def server(self) -> subprocess.Popen | WarmProcess | None:
        """The server's process (a session of its own), once started."""
        return self._server

    def _start(self) -> None:
        with self._lock:
            if self._server is not None and self._server.poll() is None:
                return
            with _quiet():
                os.unlink(self._socket)
            if self._via is not None:
                ready_r, ready_w = os.pipe()
                try:
                    self._server = self._via.start([*self._via_argv[:2], self._socket, *self._via_argv[2:],
                                                    *self.preload], env=self._env, stdout=ready_w, end_session=True)
                finally:
                    os.close(ready_w)
                with os.fdopen(ready_r, "rb") as ready:
                    line = ready.readline()
            else:
                argv = self._wrap([sys.executable, "-m", "dcp_nvme_harness.warm", self._socket, *self.preload])
                self._server = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                env=self._env, start_new_session=True)
                assert self._server.stdout is not None
                line = self._server.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(f"the warm Python server did not start (said {line!r})")

    def start(self, args: Sequence[str | os.PathLike], *, cwd: str | os.PathLike | None = None,
              env: Mapping[str, str] | None = None, stdin: int | None = None, stdout: int | None = None,
              stderr: int | None = None, end_session: bool = False) -> WarmProcess:
        """``subprocess.Popen([sys.executable, *args], ...)`` forked from the server, with the
        given file descriptors as its stdin/stdout/stderr (``/dev/null`` where None). With
        ``end_session``, whatever it started in its session is killed when it ends (as the
        processes of a pid namespace end with its first one)."""
        self._start()
        argv = [str(a) for a in args]
        header = json.dumps({"argv": argv, "cwd": os.path.abspath(cwd or os.getcwd()), "end_session": end_session,
                             "env": dict(os.environ if env is None else env)}).encode()
        devnull = os.open(os.devnull, os.O_RDWR)
        fds = [devnull if fd is None else fd for fd in (stdin, stdout, stderr)]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._socket)
            conn.sendmsg([len(header).to_bytes(8, "little") + header],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except BaseException:
            conn.close()
            raise
        finally:
            os.close(devnull)
        return WarmProcess(argv, conn)

    def run(self, args: Sequence[str | os.PathLike], *, cwd: str | os.PathLike | None = None,
            env: Mapping[str, str] | None = None, timeout: float = 120, input: str | None = None,
            ) -> subprocess.CompletedProcess:
        """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``, forked
        from the server; on timeout the process's session is killed and TimeoutExpired raised."""
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = self.start(args, cwd=cwd, env=env, stdin=stdin_r, stdout=out_w, stderr=err_w)
        finally:
            for fd in (stdin_r, out_w, err_w):
                os.close(fd)
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        feeder = threading.Thread(target=_feed, args=(stdin_w, (input or "").encode()), daemon=True)
        feeder.start()
        deadline = time.monotonic() + timeout
        try:
            open_fds = [out_r, err_r]
            while open_fds:
                left = deadline - time.monotonic()
                if left <= 0:
                    proc.kill()
                    raise subprocess.TimeoutExpired(proc.args, timeout, b"".join(chunks[out_r]),
                                                    b"".join(chunks[err_r]))
                ready, _, _ = select.select(open_fds, [], [], min(left, 1.0))
                for fd in ready:
                    data = os.read(fd, 1 << 16)
                    if data:
                        chunks[fd].append(data)
                    else:
                        open_fds.remove(fd)
            status = proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            proc.close()
            os.close(out_r)
            os.close(err_r)
        return subprocess.CompletedProcess(proc.args, status, b"".join(chunks[out_r]).decode(errors="replace"),
                                           b"".join(chunks[err_r]).decode(errors="replace"))

    def close(self) -> None:
        """End the server (and, where it runs in a namespace of its own, everything in it)."""
        if isinstance(self._server, WarmProcess):
            self._server.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._server.wait(30)
            self._server.close()
        elif self._server is not None:
            if self._server.poll() is None:
                with _quiet():
                    os.killpg(self._server.pid, signal.SIGKILL)
            self._server.wait()
            if self._server.stdout is not None:
                self._server.stdout.close()
        self._server = None
        with _quiet():
            os.unlink(self._socket)
            os.rmdir(self._dir)


class WarmProcess:
    """A process forked by a ``WarmPython`` server: ``poll``/``wait`` like ``Popen``; signals go
    through the server (the process may live in another pid namespace), to its whole session."""

    def __init__(self, args: list[str], conn: socket.socket):
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        self.pid = int(self._line(None) or -1)
        """Its pid where the server runs (another pid namespace's, for a node's server)."""

    def _line(self, timeout: float | None) -> bytes | None:
        """The next line from the waiter, None if none came within ``timeout``; b"" at its end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return None
            try:
                data = self._conn.recv(4096)
            except OSError:
                data = b""
            if not data:
                return b""
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _settle(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line == b"":  # the server (or its namespace) was killed with it
                self.returncode = -signal.SIGKILL
            elif line is not None:
                self.returncode = int(json.loads(line)["status"])
        return self.returncode

    def poll(self) -> int | None:
        return self._settle(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._settle(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        """``sig`` to the process's session (the process and what it started)."""
        if self.returncode is None:
            with _quiet():
                self._conn.sendall(f"{int(sig)}\n".encode())

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Forget it; a process still running is killed (its waiter sees the connection end)."""
        self._conn.close()


def _feed(fd: int, data: bytes) -> None:
    with _quiet(), os.fdopen(fd, "wb") as f:
        f.write(data)


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
    """In the forked waiter: fork the process itself, report its pid, pass on the signals the
    caller sends (to the process's session), and report its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become(request, fds)
    try:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        status = None
        while status is None:
            ready, _, _ = select.select([conn], [], [], 0.05)
            if ready:
                data = conn.recv(256)
                for sig in data.split() if data else [str(int(signal.SIGKILL)).encode()]:  # gone: kill
                    with _quiet():
                        os.killpg(pid, int(sig))
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(raw)
        if request.get("end_session"):
            with _quiet():
                os.killpg(pid, signal.SIGKILL)
        conn.sendall((json.dumps({"status": status}) + "\n").encode())
    except OSError:  # the caller is gone: nobody to tell
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
