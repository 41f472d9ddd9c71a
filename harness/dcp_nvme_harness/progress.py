"""The suite's pytest plugin (``-p dcp_nvme_harness.progress`` in pyproject.toml's addopts): the
markers of its lanes, and progress lines a person watching a long run can follow.

Markers, set at collection:

- ``cluster``: the simulated clusters and what runs on them: a test that uses the fixture
  ``cluster``, ``cluster3``, ``lan`` or ``seaweed`` (itself or through a fixture that needs one),
  a test of a module that imports ``dcp_nvme_harness.multinode`` (an import inside one test
  function marks that test only), and every test under ``integration/``;
- ``objstore``: a test that uses an object store's server (``seaweed``, or moto's ``s3_server``);
- ``integration``: the trainer integrations (``integration/``).

The fast lane (``scripts/dev.sh test --fast``) is ``-m "not slow and not cluster"``.

Each test belongs to one phase, from those markers: the integrations, else the object stores,
else the simulated clusters, else the unit tests. The process that reports (pytest-xdist's
controller, or the one process with ``-n 0``) prints a line when a phase's first test starts and
when its last one ends, a line every 60 s (``HARNESS_PROGRESS_EVERY`` seconds) with the tests done
and the files running, and, at the end, the time of each phase and the ``SLOWEST_FILES`` files
whose tests took longest. xdist's workers only mark and tell the controller each test's phase (a
file in a folder the controller hands them): the controller collects nothing itself.
"""

from __future__ import annotations

import ast
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

CLUSTER_FIXTURES = frozenset({"cluster", "cluster3", "lan", "seaweed"})
OBJSTORE_FIXTURES = frozenset({"seaweed", "s3_server"})
MULTINODE = "dcp_nvme_harness.multinode"

MARKERS = (
    "cluster: simulated clusters, the object store on their network, the integrations "
    "(set by dcp_nvme_harness.progress; the fast lane leaves them out)",
    "objstore: uses an object store's server (SeaweedFS or moto; set by dcp_nvme_harness.progress)",
    "integration: the trainer integrations under integration/ (set by dcp_nvme_harness.progress)",
)
PHASES = {"unit": "unit tests", "objstore": "object stores", "cluster": "simulated clusters",
          "integration": "integrations"}
"""phase -> its name in the lines; in the order of the summary."""
_BY_PRECEDENCE = ("integration", "objstore", "cluster")
SLOWEST_FILES = 15
_EXCHANGE = "dcp_nvme_progress_dir"
"""The workerinput key of the folder where each xdist worker writes its tests' phases."""


# -- markers (every process) -------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    if hasattr(config, "workerinput") or config.option.collectonly:
        return  # an xdist worker marks and reports its phases; the controller prints
    config.pluginmanager.register(Progress(config), "dcp_nvme_progress")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    integration_dir = config.rootpath / "integration"
    scans: dict[Path, tuple[bool, frozenset[str]]] = {}
    for item in items:
        path = Path(str(item.path))
        fixtures = set(getattr(item, "fixturenames", ()))
        integration = path.is_relative_to(integration_dir)
        if path not in scans:
            scans[path] = _multinode_imports(path)
        whole_module, in_tests = scans[path]
        cls = getattr(item, "cls", None)
        multinode = whole_module or getattr(item, "originalname", item.name) in in_tests or (
            cls is not None and cls.__name__ in in_tests)
        if integration:
            item.add_marker("integration")
        if integration or multinode or fixtures & CLUSTER_FIXTURES:
            item.add_marker("cluster")
        if fixtures & OBJSTORE_FIXTURES:
            item.add_marker("objstore")
    _longest_files_first(items)


def _longest_files_first(items: list[pytest.Item]) -> None:
    """The files of the simulated clusters and the integrations first, then those with other slow
    tests, then the rest; each file's tests together and in their order. xdist's ``--dist
    loadfile`` hands out files in this order: the last to start are then short ones, not a
    minute-long cluster file that a worker runs alone at the end."""
    rank: dict[Path, int] = {}
    first: dict[Path, int] = {}
    for index, item in enumerate(items):
        path = Path(str(item.path))
        first.setdefault(path, index)
        here = 0 if item.get_closest_marker("cluster") else 1 if item.get_closest_marker("slow") else 2
        rank[path] = min(rank.get(path, 2), here)
    items.sort(key=lambda item: (rank[Path(str(item.path))], first[Path(str(item.path))]))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook tells the controller the collection ended
def pytest_collection_finish(session: pytest.Session) -> None:
    where = getattr(session.config, "workerinput", {}).get(_EXCHANGE)
    if not where:
        return
    phases = {item.nodeid: phase_of(item) for item in session.items}
    target = Path(where) / f"{session.config.workerinput['workerid']}.json"  # type: ignore[attr-defined]
    temp = target.with_suffix(".tmp")
    temp.write_text(json.dumps(phases))
    temp.replace(target)


def phase_of(item: pytest.Item) -> str:
    for phase in _BY_PRECEDENCE:
        if item.get_closest_marker(phase) is not None:
            return phase
    return "unit"


def _imports_multinode(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import) and any(
                a.name == MULTINODE or a.name.startswith(MULTINODE + ".") for a in sub.names):
            return True
        if isinstance(sub, ast.ImportFrom) and sub.module and not sub.level and (
                sub.module == MULTINODE or sub.module.startswith(MULTINODE + ".")
                or (sub.module == "dcp_nvme_harness" and any(a.name == "multinode" for a in sub.names))):
            return True
    return False


def _multinode_imports(path: Path) -> tuple[bool, frozenset[str]]:
    """Whether the module at ``path`` imports the simulated nodes for all its tests (at its top,
    or in a helper), and the tests (functions ``test*``, classes ``Test*``) that import them
    themselves."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False, frozenset()
    tests = set()
    for stmt in tree.body:
        if not _imports_multinode(stmt):
            continue
        named = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if named and stmt.name.startswith("Test" if isinstance(stmt, ast.ClassDef) else "test"):  # type: ignore[union-attr]
            tests.add(stmt.name)  # type: ignore[union-attr]
        else:
            return True, frozenset()
    return False, frozenset(tests)


# -- progress (the controller, or the one process) -----------------------------------------------


def _tests(n: int | str) -> str:
    return f"{n} test" if n == 1 else f"{n} tests"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """Counts the tests of each phase as their reports come, prints the events and a heartbeat."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.every = float(os.environ.get("HARNESS_PROGRESS_EVERY", "60") or 60)
        self.t0 = time.monotonic()
        # the reporting hooks (the terminal's dots) and the heartbeat's thread take turns
        self.lock = threading.RLock()
        self.phases: dict[str, str] = {}  # nodeid -> phase
        self.total = Counter[str]()
        self.n_total: int | None = None
        self.done = Counter[str]()
        self.outcomes: dict[str, Counter[str]] = {p: Counter() for p in PHASES}
        self.test_time = Counter[str]()
        self.file_time = Counter[str]()  # file -> its tests' seconds, set-ups and teardowns included
        self.first: dict[str, float] = {}  # phase -> when its first test started
        self.last: dict[str, float] = {}  # phase -> when its last test ended
        self.running: dict[str, float] = {}  # nodeid -> when it started
        self.finished: set[str] = set()
        self.worst: dict[str, str] = {}  # nodeid -> its outcome so far
        self.exchange: str | None = None
        self.out: Any = None  # the terminal's file, dup'ed: the heartbeat's lines pass -n 0's capture
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def tr(self) -> Any:
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def line(self, message: str) -> None:
        tr = self.tr
        if tr is None:
            return
        with self.lock:
            tw = getattr(tr, "_tw", None)
            swap = (self.out is not None and tw is not None and hasattr(tw, "_file")
                    and threading.current_thread() is not threading.main_thread())
            saved = tw._file if swap else None
            if swap:
                tw._file = self.out
            try:
                if tw is not None and getattr(tw, "width_of_current_line", 0):
                    tw.line()  # the dots' line goes on after this one
                tr.write_line(f"[{_clock(time.monotonic() - self.t0)}] {message}")
                if swap:
                    self.out.flush()
            finally:
                if swap:
                    tw._file = saved

    # -- what runs

    def _phase(self, nodeid: str) -> str:
        return self.phases.get(nodeid, "unit")

    def _learn(self, phases: dict[str, str]) -> None:
        self.phases = phases
        self.total = Counter(phases.values())
        self.n_total = len(phases)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:  # xdist, controller: a worker to start
        if self.exchange is None:
            import tempfile

            self.exchange = tempfile.mkdtemp(prefix="dcp_nvme_progress_")
        node.workerinput[_EXCHANGE] = self.exchange

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if self.phases or self.exchange is None:
            return
        try:
            phases = json.loads((Path(self.exchange) / f"{node.gateway.id}.json").read_text())
        except (OSError, ValueError):
            phases = {}
        with self.lock:
            self._learn({nodeid: phases.get(nodeid, "unit") for nodeid in ids})

    def pytest_collection_finish(self, session: pytest.Session) -> None:  # -n 0: this process collected
        with self.lock:
            self._learn({item.nodeid: phase_of(item) for item in session.items})

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Any:
        tr = self.tr
        try:
            self.out = os.fdopen(os.dup(tr._tw._file.fileno()), "w", encoding="utf-8", errors="replace")
        except Exception:
            self.out = None
        self.thread = threading.Thread(target=self._beat, name="dcp-nvme-progress", daemon=True)
        self.thread.start()
        try:
            return (yield)
        finally:
            self.stop.set()
            self.thread.join(timeout=5)
            if self.out is not None:
                self.out.close()
                self.out = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> Any:
        with self.lock:
            now = time.monotonic()
            self.running[nodeid] = now
            phase = self._phase(nodeid)
            if phase not in self.first:
                self.first[phase] = now
                self.line(f"{PHASES[phase]}: started ({_tests(self.total[phase] or '?')})")
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Any:
        with self.lock:
            result = yield
            phase = self._phase(report.nodeid)
            took = getattr(report, "duration", 0.0) or 0.0
            self.test_time[phase] += took
            self.file_time[report.nodeid.partition("::")[0]] += took
            seen = self.worst.get(report.nodeid)
            if report.failed:
                self.worst[report.nodeid] = "failed"
            elif report.skipped and seen != "failed":
                self.worst[report.nodeid] = "skipped"
            elif report.when == "call" and seen is None:
                self.worst[report.nodeid] = "passed"
            if report.when not in ("setup", "call", "teardown"):  # xdist: its worker crashed
                self._finish(report.nodeid)
            return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> Any:
        with self.lock:
            result = yield
            self._finish(nodeid)
            return result

    def _finish(self, nodeid: str) -> None:
        self.running.pop(nodeid, None)
        if nodeid in self.finished:
            return
        self.finished.add(nodeid)
        phase = self._phase(nodeid)
        self.done[phase] += 1
        self.outcomes[phase][self.worst.get(nodeid, "passed")] += 1
        if self.done[phase] == self.total[phase]:
            now = self.last[phase] = time.monotonic()
            self.line(f"{PHASES[phase]}: done, {_tests(self.done[phase])} in "
                      f"{_clock(now - self.first.get(phase, now))} ({self._outcomes(phase)})")

    def _outcomes(self, phase: str) -> str:
        counts = self.outcomes[phase]
        return ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped") if counts[k]) or "none ran"

    # -- the heartbeat

    def _beat(self) -> None:
        while not self.stop.wait(self.every):
            try:
                with self.lock:
                    self.line(self._status())
            except Exception:  # a heartbeat never fails a run
                pass

    def _status(self) -> str:
        if self.n_total is None:
            return "collecting"
        done = sum(self.done.values())
        failed = sum(c["failed"] for c in self.outcomes.values())
        now = time.monotonic()
        files: dict[str, tuple[float, str]] = {}  # file -> (since, test) of its longest-running test
        for nodeid, since in self.running.items():
            name, _, test = nodeid.partition("::")
            files[name] = min(files.get(name, (since, test)), (since, test))
        running = ", ".join(f"{name} ({test[:48]} for {_clock(now - since)})"
                            for name, (since, test) in sorted(files.items(), key=lambda f: f[1]))
        return (f"{done}/{self.n_total} tests done" + (f", {failed} failed" if failed else "")
                + f"; running: {running or 'nothing (between files)'}")

    # -- the end

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.done:
            return
        terminalreporter.write_sep("-", "time per phase")
        for phase, name in PHASES.items():
            if not self.total[phase] and not self.done[phase]:
                continue
            start = self.first.get(phase)
            end = self.last.get(phase, time.monotonic())
            span = (f"{_clock(end - start)} from its first start ({_clock(start - self.t0)}) to its last end"
                    if start is not None else "did not start")
            terminalreporter.write_line(
                f"{name}: {self.done[phase]}/{_tests(self.total[phase])} ({self._outcomes(phase)}); {span}; "
                f"{_clock(self.test_time[phase])} in tests")
        terminalreporter.write_line(f"all: {_clock(time.monotonic() - self.t0)}")
        slowest = self.file_time.most_common(SLOWEST_FILES)
        if slowest:
            terminalreporter.write_sep("-", f"the {len(slowest)} slowest files (their tests' seconds)")
            for name, seconds in slowest:
                terminalreporter.write_line(f"{_clock(seconds):>8} {name}")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.exchange is not None:
            import shutil

            shutil.rmtree(self.exchange, ignore_errors=True)
