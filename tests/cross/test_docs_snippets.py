"""Every ```python snippet of README.md and docs/**/*.md runs as written.

Each snippet runs in a fresh interpreter (this checkout first on the path) with a temporary
directory as its working directory. Two rewrites, and only these, map the docs' example
locations onto test resources:

- ``/nvme/`` (the docs' node-local NVMe mount) becomes ``<tmp>/nvme/``;
- ``http://s3.local:9000`` (the docs' S3-compatible endpoint) becomes the suite's SeaweedFS
  (harness/dcp_nvme_harness/seaweed.py), in which bucket ``bucket`` exists. Snippets that use it are skipped when
  SeaweedFS or s3fs is missing.

A snippet that cannot run standalone carries ``<!-- not-run: reason -->`` on the line before
its fence; it is reported as skipped with that reason. A snippet that imports a trainer library
(lightning, megatron, torchtitan) which is not installed is skipped likewise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from dcp_nvme_harness.warm import warm_python

pytestmark = pytest.mark.slow  # each snippet runs in a process of its own

REPO = Path(__file__).resolve().parents[2]
NVME_ROOT = "/nvme/"
S3_ENDPOINT = "http://s3.local:9000"
S3_BUCKET = "bucket"
OPTIONAL_LIBRARIES = ("lightning", "megatron", "torchtitan", "accelerate")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.+?)\s*-->$")
_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


@dataclass(frozen=True)
class Snippet:
    doc: str
    line: int
    code: str
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def extract(doc: Path, root: Path = REPO) -> list[Snippet]:
    """The ```python fences of ``doc`` with their line numbers and not-run reasons."""
    lines = doc.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{doc}:{start + 1}: unclosed ```python fence"
            before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marker = _NOT_RUN.match(before)
            found.append(Snippet(str(doc.relative_to(root)), start + 1, "\n".join(lines[start + 1:end]) + "\n",
                                 marker.group(1) if marker else None))
            i = end
        i += 1
    return found


def all_snippets() -> list[Snippet]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [s for doc in docs for s in extract(doc)]


SNIPPETS = all_snippets()


def test_extract_finds_fences_and_markers(tmp_path):
    """The extractor itself: line numbers, code, and the not-run marker before a fence."""
    doc = tmp_path / "probe.md"
    doc.write_text("# t\n\n```python\nx = 1\n```\n\n<!-- not-run: needs a GPU -->\n```python\ny = 2\n```\n"
                   "```bash\nls\n```\n")
    got = extract(doc, root=tmp_path)
    assert got[0].id == "probe.md:3"
    assert [(s.line, s.code, s.not_run) for s in got] == [(3, "x = 1\n", None), (8, "y = 2\n", "needs a GPU")]


def test_every_doc_snippet_is_collected():
    """README.md and the docs hold snippets, and each either runs or says why not."""
    assert any(s.doc == "README.md" for s in SNIPPETS)
    assert len(SNIPPETS) >= 8, [s.id for s in SNIPPETS]


@pytest.fixture(scope="module")
def s3_endpoint(request):
    """SeaweedFS (the suite's object store, conftest ``seaweed``), with bucket ``bucket``: started
    only for the snippets that use the docs' S3 endpoint."""
    server = request.getfixturevalue("seaweed")
    if not server.admin.exists(S3_BUCKET):
        server.admin.mkdir(S3_BUCKET)
    return server.endpoint_url


def _rewrite(code: str, tmp: Path, endpoint: str | None) -> str:
    code = code.replace(NVME_ROOT, f"{tmp}{NVME_ROOT}")
    if endpoint is not None:
        code = code.replace(S3_ENDPOINT, endpoint)
    return code


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_doc_snippet_runs(snippet: Snippet, tmp_path, request):
    if snippet.not_run:
        pytest.skip(f"not run ({snippet.id}): {snippet.not_run}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("OMP_NUM_THREADS", "1")
    # never reach AWS: no metadata probe for credentials, a region for botocore
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="eu-west-1")
    endpoint = request.getfixturevalue("s3_endpoint") if S3_ENDPOINT in snippet.code else None
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    script = run_dir / "snippet.py"
    script.write_text(_rewrite(snippet.code, tmp_path, endpoint))
    proc = warm_python().run([script], cwd=run_dir, env=env, timeout=600)  # as `python snippet.py`
    if proc.returncode != 0:
        missing = _MISSING_MODULE.search(proc.stderr)
        if missing and missing.group(1).split(".")[0] in OPTIONAL_LIBRARIES:
            pytest.skip(f"{snippet.id} needs {missing.group(1)}, which is not installed")
        pytest.fail(f"{snippet.id} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _bash_fences(doc: str) -> list[list[str]]:
    """The lines of each ```bash fence of ``doc``."""
    fences: list[list[str]] = []
    inside = False
    for line in (REPO / doc).read_text().splitlines():
        if line.strip().startswith("```"):
            inside = line.strip() == "```bash"
            if inside:
                fences.append([])
        elif inside:
            fences[-1].append(line.strip())
    return fences


_S3_CLIENT = """
import sys, time, s3fs
opts = {"endpoint_url": "http://127.0.0.1:8333", "key": "any", "secret": "any"}
deadline = time.monotonic() + 60
while True:
    try:
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("bucket")
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.3)
data = bytes(range(256)) * 4096
fs.pipe("bucket/x", data)
assert fs.cat("bucket/x") == data and fs.cat_file("bucket/x", start=5, end=9) == data[5:9]
print("served", len(data))
"""


def test_the_seaweedfs_command_of_the_tiers_doc_serves_s3():
    """docs/tiers.md's `weed server` line, as written, in a network and mount namespace of its
    own (its fixed ports cannot meet another server's; a tmpfs /tmp for its data and sockets),
    then the doc's client options: a bucket, a write, a ranged read."""
    from dcp_nvme_harness.multinode import unshare_unavailable
    from dcp_nvme_harness.seaweed import seaweed_unavailable, weed_binary

    reason = unshare_unavailable() or seaweed_unavailable()
    if reason:
        pytest.skip(reason)
    (fence,) = [f for f in _bash_fences("docs/tiers.md") if any(line.startswith("weed server") for line in f)]
    # the fence as written, the server in the background
    commands = "\n".join(f"{line} >/dev/null 2>&1 &" if line.startswith("weed ") else line for line in fence)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # as the doc says
    env["DOC_S3_CLIENT"] = _S3_CLIENT  # (the tmpfs hides tmp_path)
    weed_dir = os.path.dirname(weed_binary() or "")
    env["PATH"] = os.pathsep.join([weed_dir, env.get("PATH", "")])
    # the tmpfs on /tmp hides a checkout or environment under /tmp (CI clones there): each is
    # opened first and bound back at its path after (mount -c: by the fd, not by its name)
    keep = sorted({path for path in (sys.prefix, weed_dir, str(REPO)) if path.startswith("/tmp/")})
    opened = " ".join(f'{3 + i}<"{path}"' for i, path in enumerate(keep))
    back = "".join(f'mkdir -p "{path}"; mount -c --bind /proc/self/fd/{3 + i} "{path}"\n'
                   for i, path in enumerate(keep))
    shell = (f'set -e; ip link set lo up\n{"exec " + opened if keep else ""}\nmount -t tmpfs tmpfs /tmp\n'
             f'{back}{commands}\n{sys.executable} -c "$DOC_S3_CLIENT"')
    proc = subprocess.run(["unshare", "--net", "--mount", "--propagation", "private", "--fork", "--pid",
                           "--kill-child", "sh", "-c", shell],
                          capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and "served 1048576" in proc.stdout, proc.stdout + proc.stderr[-3000:]
