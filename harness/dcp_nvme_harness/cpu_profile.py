"""pytest plugin: the CPU seconds of each test, its own process and everything it started.

On 2 shared cores the suite's wall time follows its CPU time, and wall times swing with what
else runs; CPU seconds do not. ``-p dcp_nvme_harness.cpu_profile --cpu-profile=DIR`` puts each
test process (each xdist worker) in a cgroup of its own (cgroup v1 ``cpuacct``, or v2's
``cpu.stat``), whose count includes every process it starts (servers, simulated nodes, ranks),
and appends one JSON line per test to ``DIR/cpu_<worker>.jsonl``: ``{"id", "cpu", "wall"}``
(setup, call and teardown together). ``python -m dcp_nvme_harness.cpu_profile DIR [BASE_DIR]``
sums them per file (and compares with an earlier run). Needs root; without a writable cgroup
hierarchy the plugin says so once and records nothing.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_V1 = Path("/sys/fs/cgroup/cpuacct")
_V2 = Path("/sys/fs/cgroup/unified")
_state: dict[str, Path] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-profile", metavar="DIR", default=None,
                     help="record each test's CPU seconds (its processes' cgroup) in DIR/cpu_<worker>.jsonl")


def _usage() -> float:
    group = _state["group"]
    if (group / "cpuacct.usage").exists():
        return int((group / "cpuacct.usage").read_text()) / 1e9
    for line in (group / "cpu.stat").read_text().splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    raise OSError(f"{group}: no CPU count")


def pytest_configure(config: pytest.Config) -> None:
    out = config.getoption("--cpu-profile")
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    root = _V1 if _V1.is_dir() else _V2
    group = root / f"dcp_nvme_tests_{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        _state["group"] = group
        _usage()
    except OSError as exc:
        _state.clear()
        print(f"cpu_profile: no cgroup to count in ({exc}); nothing recorded", file=sys.stderr)
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    _state["out"] = Path(out) / f"cpu_{worker}.jsonl"


def pytest_unconfigure(config: pytest.Config) -> None:
    group = _state.get("group")
    if group is not None:  # back to the hierarchy's root; the group goes once its processes have
        try:
            (group.parent / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if "out" not in _state:
        yield
        return
    cpu, wall = _usage(), time.monotonic()
    yield
    record = {"id": item.nodeid, "cpu": round(_usage() - cpu, 3), "wall": round(time.monotonic() - wall, 3)}
    with open(_state["out"], "a") as f:
        f.write(json.dumps(record) + "\n")


def per_file(directory: str | os.PathLike) -> dict[str, float]:
    """CPU seconds per test file of a ``--cpu-profile`` directory."""
    sums: dict[str, float] = collections.defaultdict(float)
    for path in Path(directory).glob("cpu_*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            sums[record["id"].split("::")[0]] += float(record["cpu"])
    return dict(sums)


def main(argv: list[str]) -> None:
    now = per_file(argv[0])
    before = per_file(argv[1]) if len(argv) > 1 else {}
    print(f"{'before':>8} {'now':>8}  file (CPU seconds)" if before else f"{'now':>8}  file (CPU seconds)")
    for name in sorted(set(now) | set(before), key=lambda n: -max(now.get(n, 0), before.get(n, 0))):
        cells = f"{before.get(name, 0):8.1f} {now.get(name, 0):8.1f}" if before else f"{now.get(name, 0):8.1f}"
        print(f"{cells}  {name}")
    total = f"{sum(before.values()):8.1f} {sum(now.values()):8.1f}" if before else f"{sum(now.values()):8.1f}"
    print(f"{total}  all")


if __name__ == "__main__":
    main(sys.argv[1:])
