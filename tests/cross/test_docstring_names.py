"""Every name of ours that the text names exists: the docstrings and comments of ``dcp_nvme/`` and
the pages README.md, docs/*.md and docs/integrations/*.md. Static: read with ast and tokenize,
nothing imported.

What counts as a reference (anything else is not checked, so that ``torch.distributed.x``,
``os.path``, ``self.x`` or a local variable's attribute never fails):

- a dotted token whose first part is ``dcp_nvme``, one of the package's own top-level modules
  and folders (``save``, ``format``, ``config`` ...) or a module name a restructure retired
  (``RETIRED``: always stale): in docstrings and comments when backticked (``save.writer``), in
  the pages anywhere (their code blocks name modules unquoted). A last part that is a file
  suffix (``tune.json``) makes it a file name, not a reference;
- anywhere in docstrings, comments and the pages: a dotted name starting ``dcp_nvme.``
  (``dcp_nvme.a.b:name``, the seams' form, counts too);
- anywhere in docstrings, comments and the pages: a path ``dcp_nvme/...py``, ``<folder>/...py``
  for one of the package's folders, or ``tests/...py``.

A name resolves when it is a module of the package (``dcp_nvme.`` may be left off), optionally
followed by a name the module defines at its top level (a package's ``__init__``: or imports),
optionally followed by a member (method, attribute) of a class there. A path resolves when the
file exists.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dcp_nvme"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
         *sorted((REPO / "docs" / "integrations").glob("*.md"))]

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+"
_BACKTICKED = re.compile(r"(?<!`)(`+)([^`]+?)\1(?!`)")
_FILE_SUFFIXES = {"py", "json", "md", "toml", "yaml", "yml", "txt", "log", "csv", "bin", "sh", "cfg", "ini",
                  "png", "svg", "html", "parquet", "dcz"}
_NAME_IN_SPAN = re.compile(rf"(?<![\w.]){_DOTTED}")
_OURS_ANYWHERE = re.compile(r"(?<![\w./-])dcp_nvme(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
_PATH = re.compile(r"(?<![\w./-])(?:[\w.-]+/)+[\w.-]*\w\.py(?!\w)")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()
OUR_TOPS = {name.split(".")[1] for name in MODULES if name.count(".") >= 1} - {"__main__"}
OUR_FOLDERS = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
RETIRED = {"layout", "node", "savelock", "rundir", "placement", "node_budget", "plan_cache", "waves", "bounded",
           "telemetry", "peer_client", "peer_server"}
"""Modules of ours that restructures merged away: a dotted token starting with one (``layout.x``)
is a reference to what is now elsewhere."""


def _bound(targets: list[ast.expr]) -> set[str]:
    names = set()
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.add(node.id)
    return names


def _statement_names(body: list[ast.stmt], imports: bool = False) -> dict[str, ast.ClassDef | None]:
    """Names a block of statements defines (descending into if/try/with), classes with their node;
    with ``imports``, the names it imports too."""
    names: dict[str, ast.ClassDef | None] = {}
    for node in body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, ast.Assign):
            names.update(dict.fromkeys(_bound(node.targets)))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names.update(dict.fromkeys(_bound([node.target])))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and imports:
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            blocks = [getattr(node, field, []) for field in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            for block in blocks:
                names.update(_statement_names(block, imports))
    return names


@cache
def _top_level(module: str) -> dict[str, ast.ClassDef | None]:
    """What a module defines; a package's ``__init__`` also what it imports (its public names):
    a name another module only imports for its own use lives elsewhere, and the text names that."""
    tree = ast.parse(MODULES[module].read_text())
    names = _statement_names(tree.body, imports=MODULES[module].name == "__init__.py")
    for node in tree.body:  # names a module's __getattr__ hands out lazily, listed in __all__
        if isinstance(node, ast.Assign) and "__all__" in _bound(node.targets):
            names.update(dict.fromkeys(ast.literal_eval(node.value)))
    for node in tree.body:  # an instance of a class of the module (``seams.drain: Seam[...] = Seam(...)``): its members
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and names.get(value.func.id) is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(dict.fromkeys(_bound(targets), names[value.func.id]))
    return names


def _members(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes and the ``self.x`` its methods assign."""
    members = set(_statement_names(cls.body))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            members.add(node.attr)
    return members


def resolves(name: str) -> bool:
    """Whether ``name`` (``dcp_nvme.`` optional) is a module of the package, a name at its top
    level, or a member of a class there."""
    parts = name.replace(":", ".").split(".")
    if parts[0] in RETIRED:
        return False
    if parts[0] != "dcp_nvme":
        parts = ["dcp_nvme", *parts]
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in MODULES:
            break
    else:
        return False
    rest = parts[cut:]
    if not rest:
        return True
    names = _top_level(module)
    if rest[0] not in names:
        return False
    if len(rest) == 1:
        return True
    cls = names[rest[0]]
    return len(rest) == 2 and cls is not None and rest[1] in _members(cls)


def path_exists(path: str) -> bool | None:
    """Whether a path of ours exists; None when the path is not one of ours."""
    first = path.split("/")[0]
    if first in ("dcp_nvme", "tests"):
        return (REPO / path).is_file()
    if first in OUR_FOLDERS:
        return (PACKAGE / path).is_file()
    return None


def _text_of(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of a module's docstrings (every bare string statement) and comments."""
    source = path.read_text()
    found = [(node.lineno, node.value.value) for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
             and isinstance(node.value.value, str)]
    found += [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
              if token.type == tokenize.COMMENT]
    return found


def _stale_in(text: str, page: bool = False) -> list[tuple[int, str]]:
    """(offset, name) of each stale name or path in ``text``."""
    found = [(m.start(), m.group()) for m in _OURS_ANYWHERE.finditer(text)]
    spans = [(0, text)] if page else [(span.start(2), span.group(2)) for span in _BACKTICKED.finditer(text)]
    for start, span in spans:
        found += [(start + m.start(), m.group()) for m in _NAME_IN_SPAN.finditer(span)
                  if m.group().split(".")[0] in OUR_TOPS | RETIRED | {"dcp_nvme"}
                  and m.group().rsplit(".", 1)[1] not in _FILE_SUFFIXES]
    stale = {(offset, name) for offset, name in found if not resolves(name)}
    stale |= {(m.start(), m.group()) for m in _PATH.finditer(text) if path_exists(m.group()) is False}
    return sorted(stale)


def stale_in_module(path: Path) -> list[str]:
    """``file:line: name`` for each name or path a module's docstrings and comments name that is
    not there. A docstring is read whole, so a double-backticked span may cross a line break."""
    where = path.relative_to(REPO)
    return [f"{where}:{line + text[:offset].count(chr(10))}: {name}"
            for line, text in _text_of(path) for offset, name in _stale_in(text)]


def stale_in_page(path: Path) -> list[str]:
    where = path.relative_to(REPO)
    return [f"{where}:{number}: {name}"
            for number, text in enumerate(path.read_text().splitlines(), start=1)
            for _, name in _stale_in(text, page=True)]


def test_the_rule_sees_our_names() -> None:
    assert {"save", "load", "format", "engines", "storage", "host", "tiers", "peers", "config"} <= OUR_TOPS
    assert resolves("dcp_nvme.save.writer") and resolves("save.writer")
    assert resolves("dcp_nvme.seams.Seam.plug") and resolves("seams.drain.plug") and resolves("dcp_nvme.NVMeWriter")
    assert not resolves("dcp_nvme.node") and not resolves("save.writer.no_such_name")
    assert not resolves("layout.place_congruent") and not OUR_TOPS & RETIRED
    assert _stale_in("``torch.distributed.checkpoint`` ``os.path`` ``self.x`` `tune.json`") == []
    assert [name for _, name in _stale_in("see save/no_such.py, tests/no_such.py; torch/save.py")] == [
        "save/no_such.py", "tests/no_such.py"]


def test_docstrings_and_comments_name_what_exists() -> None:
    stale = [entry for path in sorted(PACKAGE.rglob("*.py")) for entry in stale_in_module(path)]
    assert not stale, "stale references in dcp_nvme/ (point them at where the thing lives now):\n" + \
        "\n".join(stale)


def test_pages_name_what_exists() -> None:
    stale = [entry for path in PAGES for entry in stale_in_page(path)]
    assert not stale, "stale references in README.md and docs/:\n" + "\n".join(stale)


_TRACKER = re.compile(r"\b[Ii]ssues? #?\d+|\([Ii]tems? \d+")
_OUR_SOURCES = [PACKAGE, REPO / "tests", REPO / "benchmarks", REPO / "harness", REPO / "integration"]
PRESENT_TENSE = ["architecture.md", "format.md", "decisions.md", "design.md"]
"""The pages that say how the code is now: no marks of what changed or was added when."""


def test_new_pages_are_checked() -> None:
    assert {page.name for page in PAGES} >= {*PRESENT_TENSE, "benchmarks.md", "benchmarks-history.md"}


def test_no_tracker_numbers() -> None:
    """Code, docstrings, comments and pages say what the code does, not which ticket asked for it
    (the whole source is read, not only its docstrings: parsing every file would cost seconds)."""
    texts = [path for root in _OUR_SOURCES for path in root.rglob("*.py")] + PAGES
    found = [f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}: {m.group()}"
             for path in sorted(texts) for text in [path.read_text()] for m in _TRACKER.finditer(text)]
    assert not found, "tracker numbers (say what the code does instead):\n" + "\n".join(found)


def test_present_tense_pages_narrate_no_history() -> None:
    marks = [f"{name}:{number}: {text.strip()[:80]}" for name in PRESENT_TENSE
             for number, text in enumerate((REPO / "docs" / name).read_text().splitlines(), start=1)
             if re.search(r"\((?:changed|added|new|was)\b", text, re.IGNORECASE)]
    assert not marks, "pages of how it is now that narrate what changed:\n" + "\n".join(marks)


def test_architecture_lists_every_seam() -> None:
    """docs/architecture.md's table of seams has one row per seam ``seams.py`` defines, no more."""
    tree = ast.parse((PACKAGE / "seams.py").read_text())
    defined = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
               and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "Seam"
               for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
               if isinstance(target, ast.Name)}
    page = (REPO / "docs" / "architecture.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", page.split("## Seams", 1)[1].split("\n## ", 1)[0], re.MULTILINE))
    assert defined and rows == defined, f"seams.py defines {sorted(defined)}; docs/architecture.md lists {sorted(rows)}"


def test_no_orphaned_docstring():
    """A bare string statement documents what stands right before it: the start of a module,
    class or function, or an assignment (an attribute docstring). One anywhere else documents
    nothing (it was left behind when the code it described moved)."""
    orphans = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if not isinstance(body, list):
                continue
            for index, statement in enumerate(body):
                if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                        and isinstance(statement.value.value, str)):
                    continue
                before = body[index - 1] if index else None
                if before is not None and not isinstance(before, (ast.Assign, ast.AnnAssign)):
                    orphans.append(f"{path.relative_to(PACKAGE.parent)}:{statement.lineno}")
    assert not orphans, "string statements that document nothing:\n" + "\n".join(orphans)
