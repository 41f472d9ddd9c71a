"""The package's folders are its architecture: each layer imports only the layers below it,
no module imports itself back through another, and no module grows past one screenful of
concerns (600 lines). Static: read from the source, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dcp_nvme"

# lowest first; a layer may import any layer before it, never one after it
LAYERS = [
    {"errors", "humanize", "lazy_imports", "config", "compat"},
    {"format"},
    {"observe", "storage"},
    {"engines"},
    {"load"},
    {"tiers"},
    {"save"},
    {"tools", "tune", "bench", "integrations", "cli", "__main__", "__init__"},
]
MAX_LINES = 600
MAX_TOP_LEVEL_MODULES = 6


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _runtime_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that ``name`` imports, anywhere in it but under ``TYPE_CHECKING``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module}: its folder {top!r} is in no layer of this test; add it")


def test_every_layer_imports_only_layers_below_it():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for imported in _runtime_imports(name, path, modules):
            if imported != "dcp_nvme" and _layer(imported) > _layer(name):
                upward.append(f"{name} imports {imported}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {name: _runtime_imports(name, path, modules) - {"dcp_nvme"} for name, path in modules.items()}
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


def test_the_reader_never_imports_the_writer_and_engines_know_nothing_of_dcp():
    modules = _modules()
    for name, path in modules.items():
        imported = _runtime_imports(name, path, modules)
        if name.startswith("dcp_nvme.load"):
            assert not {m for m in imported if m.startswith("dcp_nvme.save")}, name
        if name.startswith("dcp_nvme.engines"):
            assert "torch.distributed.checkpoint" not in path.read_text(), f"{name} knows DCP"
