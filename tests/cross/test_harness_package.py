"""What is shipped stands alone: the wheel of dcp_nvme holds no test code, and none of its modules
reaches for the test harness (``dcp_nvme_harness``, installed beside it in development only), the
tests, or a ``sys.path`` of its own -- checked on the built wheel, unzipped and imported in a
process where its copy shadows the checkout. And the suites reach the harness as an installed
package, never by putting folders on ``sys.path``."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("tests", "dcp_nvme_harness", "conftest")
"""Top-level modules the package must never import."""
NOT_SHIPPED = ("dcp_nvme_harness/", "tests/", "integration/", "benchmarks/", "harness/", "conftest.py")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the project root, built (no network) from a copy of what the build reads, so
    that no build/ or egg-info lands in the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "dcp_nvme", source / "dcp_nvme", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(root / "dist"), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (built,) = (root / "dist").glob("dcp_nvme-*.whl")
    return built


@pytest.fixture(scope="module")
def unzipped(wheel, tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("unzipped")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(where)
    return where


def _sys_path_changes(tree: ast.AST) -> list[int]:
    """Lines that change ``sys.path``: a call of one of its methods, an assignment to it or to an item."""
    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            lines.append(node.lineno)
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if is_sys_path(target) or (isinstance(target, ast.Subscript) and is_sys_path(target.value)):
                lines.append(node.lineno)
        if isinstance(node, ast.Delete) and any(isinstance(t, ast.Subscript) and is_sys_path(t.value)
                                                for t in node.targets):
            lines.append(node.lineno)
    return lines


def _forbidden_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        else:
            continue
        found += [f"{name} (line {node.lineno})" for name in names if name.split(".")[0] in FORBIDDEN]
    return found


def test_the_wheel_holds_the_package_only(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert not [n for n in names if n.startswith(NOT_SHIPPED) or "/tests/" in n or n.endswith("/conftest.py")]
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"dcp_nvme"}, sorted(tops)
    assert "dcp_nvme/cli.py" in names and "dcp_nvme/py.typed" in names


def test_no_shipped_module_imports_the_harness_or_the_tests_or_changes_sys_path(unzipped):
    files = sorted(unzipped.rglob("*.py"))
    assert len(files) > 50, files  # the package, not an empty wheel
    bad = {}
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found = _forbidden_imports(tree) + [f"sys.path changed (line {n})" for n in _sys_path_changes(tree)]
        if found:
            bad[str(path.relative_to(unzipped))] = found
    assert not bad, bad


@pytest.mark.slow  # ~12 s on 2 cores: torch and the three trainers load
def test_every_shipped_module_imports_from_the_wheel_alone(unzipped):
    """Each module of the unzipped package, imported in a fresh interpreter whose path starts at
    the unzipped wheel (it shadows the editable checkout; the working directory is elsewhere), and
    after all of them nothing of the harness or the tests is loaded. A module whose optional
    third-party library is not installed (kvikio, a trainer) is left out, by its library's name."""
    modules = sorted(
        ".".join(p.relative_to(unzipped).with_suffix("").parts[:-1] if p.name == "__init__.py"
                 else p.relative_to(unzipped).with_suffix("").parts)
        for p in (unzipped / "dcp_nvme").rglob("*.py"))
    modules.remove("dcp_nvme.__main__")  # the command itself: it runs on import
    code = textwrap.dedent(f"""
        import importlib, json, sys, traceback
        failed, missing = {{}}, {{}}
        for name in {modules!r}:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                cause = exc  # an integration names its trainer's pip package, from the ImportError of its import
                while cause is not None and not getattr(cause, "name", None):
                    cause = cause.__cause__
                top = (getattr(cause, "name", None) or "").split(".")[0]
                if top and top != "dcp_nvme" and top not in {FORBIDDEN!r}:
                    missing[name] = cause.name
                else:
                    failed[name] = traceback.format_exc()[-1500:]
            except Exception:
                failed[name] = traceback.format_exc()[-1500:]
        import dcp_nvme
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {FORBIDDEN!r})
        print(json.dumps({{"file": dcp_nvme.__file__, "failed": failed, "missing": missing, "loaded": loaded}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(unzipped)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=unzipped)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve().is_relative_to(unzipped.resolve()), result["file"]
    assert not result["failed"], result["failed"]
    assert not result["loaded"], result["loaded"]
    # only the optional systems may miss a library
    assert all(name.startswith(("dcp_nvme.integrations.", "dcp_nvme.engines.kvikio")) for name in result["missing"]), \
        result["missing"]


def test_no_suite_puts_folders_on_sys_path():
    """tests/, benchmarks/ and integration/ import the harness and the package as installed ones
    (scripts/dev.sh installs both, editable); a file that edits ``sys.path`` would find another copy."""
    patterns = ("sys.path" + ".insert", "sys.path" + ".append", "sys.path" + "[")
    found = []
    for folder in ("tests", "benchmarks", "integration"):
        for path in sorted((REPO / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            found += [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                      if any(p in line for p in patterns)]
    assert not found, "\n".join(found)
