"""The package's folders are its architecture: each layer imports only the layers below it, the
core never imports the optional systems (they plug into ``dcp_nvme.seams``), no module imports
itself back through another -- imports made only for type checking count as imports here, so no
cycle hides behind ``TYPE_CHECKING`` -- and no module grows past one screenful of concerns (600
lines). No module listens on a socket: bytes between nodes go over the job's own gloo groups.
Static: read from the source, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent.parent / "dcp_nvme"

# lowest first, in the order the data flows; a layer may import any layer before it, never one after it
LAYERS = [
    {"errors", "humanize", "lazy_imports", "compat", "config"},  # words, options
    {"host"},  # file primitives, the launcher's identity
    {"format"},  # what is on disk
    {"engines", "storage", "seams"},  # how bytes move; the checkpoint directory; the hook points (typed in these)
    {"save", "load"},  # DCP's StorageWriter / StorageReader
    {"observe", "peers"},  # optional: diagnostics; other nodes' copies
    {"tiers"},  # optional: the drain to a mirror, its compression
    {"tools", "tune", "bench", "integrations", "cli", "__main__", "__init__"},
]
CORE = {"errors", "humanize", "lazy_imports", "compat", "config", "seams", "host", "format", "engines",
        "storage", "save", "load"}
"""What a plain dcp.save / dcp.load / dcp.async_save runs."""
MAX_LINES = 600
MAX_TOP_LEVEL_MODULES = 7
MAX_TYPE_CHECKING_IMPORTS = 11  # seams.py's 4: its signatures name torch and core types it does not load


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that ``name`` imports, anywhere in it, ``TYPE_CHECKING`` blocks included."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _type_checking_imports(path: Path) -> int:
    """Import statements inside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    return sum(isinstance(node, (ast.Import, ast.ImportFrom))
               for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
               for node in ast.walk(block))


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module}: its folder {top!r} is in no layer of this test; add it")


def _top(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def test_every_layer_imports_only_layers_below_it():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for imported in _imports(name, path, modules):
            if imported != "dcp_nvme" and _layer(imported) > _layer(name):
                upward.append(f"{name} imports {imported}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(sorted(upward))


def test_the_core_never_imports_the_optional_systems():
    """save/load/format/engines/storage/host reach tiers, peers and observe only through seams."""
    modules = _modules()
    reached = sorted(f"{name} imports {imported}" for name, path in modules.items() if _top(name) in CORE
                     for imported in _imports(name, path, modules) if _top(imported) not in CORE)
    assert not reached, "the core imports optional systems:\n" + "\n".join(reached)


def test_save_and_load_are_siblings_and_engines_know_nothing_of_dcp():
    modules = _modules()
    for name, path in modules.items():
        imported = {_top(m) for m in _imports(name, path, modules)}
        if _top(name) == "load":
            assert "save" not in imported, name
        if _top(name) == "save":
            assert "load" not in imported, name
        if _top(name) == "engines":
            assert "torch.distributed.checkpoint" not in path.read_text(), f"{name} knows DCP"


def test_the_restore_imports_nothing_of_the_reader():
    """A restore (``peers/``) is reached through ``seams.restore``, whose types the core defines:
    what came and what was kept live in ``peers/``, so peers/ imports nothing of ``load/``."""
    modules = _modules()
    reached = sorted(f"{name} imports {imported}" for name, path in modules.items() if _top(name) == "peers"
                     for imported in _imports(name, path, modules) if _top(imported) == "load")
    assert not reached, "peers/ imports load/:\n" + "\n".join(reached)


def test_type_checking_imports_are_counted_and_few():
    """Imports for type checking only are imports all the same (the cycle and layer tests see them);
    they are kept for what would otherwise load torch or a heavy module at import time."""
    counts = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := _type_checking_imports(p))}
    assert sum(counts.values()) <= MAX_TYPE_CHECKING_IMPORTS, counts


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) - {"dcp_nvme"} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return trail + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, trail + [node])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [])):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_no_module_over_600_lines_and_few_at_the_top():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"modules directly in dcp_nvme/: {top}"


SERVING_CALLS = {"listen", "bind", "accept", "create_server", "start_server", "start_unix_server", "serve_forever"}
"""Attribute calls that make or run a listening endpoint (``sock.listen(``, ``asyncio.start_server(``...)."""
SOCKET_CALLS = {"socket", "create_server", "create_connection", "socketpair", "fromfd"}
"""``socket.<name>(``: a socket of our own, of any kind."""
SERVER_MODULES = {"socketserver", "http.server", "xmlrpc.server", "wsgiref.simple_server", "asyncio.start_server"}
ALLOWED_SOCKET_USES = {
    # free_port(): binds port 0 on loopback only to learn a free port for the bench's own
    # torch.distributed rendezvous (MASTER_PORT), and closes the socket at once: it never listens
    "bench/group.py": {"socket.socket", ".bind"},
}


def _socket_uses(path: Path) -> set[str]:
    """What ``path`` does with sockets and servers: ``socket.<name>``, ``.<serving call>``, ``import <module>``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "socket" and node.func.attr in SOCKET_CALLS:
                found.add(f"socket.{node.func.attr}")
            elif node.func.attr in SERVING_CALLS:
                found.add(f".{node.func.attr}")
        elif isinstance(node, ast.Import):
            found.update(f"import {a.name}" for a in node.names if a.name in SERVER_MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            found.update(f"import {n}" for n in names & SERVER_MODULES)
            if node.module == "socket":
                found.update(f"socket.{a.name}" for a in node.names if a.name != "gethostname")
    return found


def test_no_module_listens_on_a_socket():
    """No server of ours: restores and replication move bytes over the job's gloo groups
    (peers/exchange.py, peers/replicate.py). The one socket is the bench's free-port probe."""
    uses = {str(p.relative_to(PACKAGE)): u for p in PACKAGE.rglob("*.py") if (u := _socket_uses(p))}
    extra = {name: sorted(u - ALLOWED_SOCKET_USES.get(name, set())) for name, u in uses.items()
             if u - ALLOWED_SOCKET_USES.get(name, set())}
    assert not extra, f"sockets or servers of our own: {extra}"
    assert uses == ALLOWED_SOCKET_USES, "the allowed uses changed: update ALLOWED_SOCKET_USES"


def test_the_type_check_covers_the_whole_package():
    """CI runs a bare ``mypy``: its files are the package, not the core alone."""
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["files"] == ["dcp_nvme"], config["files"]


def _seam_calls(path: Path) -> set[str]:
    """``seams.<name>(`` calls in ``path``."""
    return {node.func.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "seams"}


def _defined(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_save_modules_each_hold_one_part_of_a_save():
    """The writer plans, writes and commits; what follows a commit is ``after_commit``'s (the node
    commit runs it without calling back into the writer); the stager's hand-off to the save is
    ``handoff``'s (no process-wide registry in the writer's modules); ``items`` is the start of a
    save's write and ``results`` its end."""
    modules = _modules()
    save = {name.rsplit(".", 1)[1]: path for name, path in modules.items() if name.startswith("dcp_nvme.save.")}
    assert {"drain", "replicate"} <= _seam_calls(save["after_commit"])
    assert not {"drain", "replicate"} & _seam_calls(save["writer"]), "the writer starts after-commit work itself"
    imports = {short: {m.rsplit(".", 1)[-1] for m in _imports(f"dcp_nvme.save.{short}", path, modules)}
               for short, path in save.items()}
    assert "after_commit" in imports["node_commit"] and "writer" not in imports["node_commit"]
    assert "handoff" in imports["stager"] and not {"items", "results"} & imports["stager"]
    assert not imports["handoff"] & set(save), "the hand-off is the stager's and the writer's alone"
    assert {"resolve_item", "unique_keys", "with_pads"} <= _defined(save["items"])
    assert {"write_results", "collect_rows", "layer_summary"} <= _defined(save["results"])
    assert not _defined(save["items"]) & _defined(save["results"])
    assert "items" not in imports["results"] and "results" not in imports["items"]
