"""The structure rules `make lint` checks (CONTRIBUTING.md, "Checks"):

1. no import circle among `worker/` modules (every import counts, at module level or inside a function, except
   those under `if TYPE_CHECKING:`);
2. no module under `tests/` imports a test module: shared code lives in `tests/support/` (or `tests/conftest.py`);
3. no function over 80 lines in `paramserver/` and `worker/`;
4. no module over 500 lines in `paramserver/` and `worker/` (the generated `paramserver/v1/` aside).

    python tools/check_structure.py [ROOT]   ->   one line per breach, exit status 1 if any

What breaks a rule today and belongs to another piece of work is in an allow-list below, with its owner; an entry
that no longer breaks its rule is printed as a note, to be removed.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500
SIZED = ("paramserver", "worker")
_SELF = "tools/check_structure.py"
GENERATED = ("paramserver/v1/",)

# Functions over MAX_FUNCTION_LINES, each with the work that splits it ("path::qualified name": owner).
LONG_FUNCTIONS: dict[str, str] = {}
# Modules over MAX_MODULE_LINES ("path": owner).
LONG_MODULES: dict[str, str] = {}
# Worker import circles still to break (the modules of one circle: owner). None today.
WORKER_CIRCLES: dict[frozenset[str], str] = {}
# Test modules that still import another test module ("importer -> imported"). None today.
TEST_IMPORTS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Breach:
    """One rule broken at one place; `stale`: an allow-list entry that no longer breaks its rule (a note)."""

    path: str
    line: int
    message: str
    stale: bool = False

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def _python_files(root: Path, folder: str) -> Iterator[Path]:
    yield from sorted(p for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `body`, at any depth, except those under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from imports(node.orelse)
            continue
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                yield from imports([v for v in value if isinstance(v, ast.stmt)])
        if isinstance(node, ast.Try | ast.TryStar):
            for handler in node.handlers:
                yield from imports(handler.body)
        if isinstance(node, ast.Match):
            for case in node.cases:
                yield from imports(case.body)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> Iterator[tuple[str, ...]]:
    """What each name of an import statement may load, most specific first: `from a.b import c` loads the module
    a.b.c if there is one, else a.b."""
    if isinstance(node, ast.Import):
        yield from ((alias.name,) for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        yield (f"{base}.{alias.name}", base)


def import_graph(root: Path, folder: str) -> dict[str, dict[str, int]]:
    """Module -> {module of the same tree it imports: the line of the first such import}."""
    files = {_module_name(root, p): p for p in _python_files(root, folder)}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in imports(tree.body):
            for candidates in _targets(node, name, path.name == "__init__.py"):
                target = next((c for c in candidates if c in files), None)
                if target is not None and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def check_circles(root: Path, folder: str = "worker") -> Iterator[Breach]:
    graph = import_graph(root, folder)
    cycles = circles(graph)
    for cycle in cycles:
        if cycle in WORKER_CIRCLES:
            continue
        first = min(cycle)
        path = (root / first.replace(".", "/")).with_suffix(".py")
        if not path.exists():
            path = root / first.replace(".", "/") / "__init__.py"
        edges = ", ".join(
            f"{a} -> {b} (line {line})" for a in sorted(cycle) for b, line in graph[a].items() if b in cycle
        )
        yield Breach(_rel(root, path), 1, f"import circle among {len(cycle)} modules: {edges}")
    for cycle in set(WORKER_CIRCLES) - set(cycles):
        yield Breach(_SELF, 1, f"no longer a circle, remove from WORKER_CIRCLES: {sorted(cycle)}", stale=True)


def check_test_imports(root: Path) -> Iterator[Breach]:
    """A module under tests/ (tests/support/ aside) imports no other module of tests/ but conftest and support."""
    tests = root / "tests"
    # tests/ is on sys.path (pytest's rootdir-relative import of a folder without __init__.py), so a test module
    # is imported by its file name: `from test_data_socket import ...`.
    shared = {"conftest", "support"}
    modules = {p.stem for p in tests.glob("*.py")} - shared
    seen: set[str] = set()
    for path in _python_files(root, "tests"):
        if "support" in path.relative_to(tests).parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in imports(tree.body):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                parts = name.split(".")
                head = parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]
                if getattr(node, "level", 0) or head not in modules or head == path.stem:
                    continue
                key = f"{path.stem} -> {head}"
                seen.add(key)
                if key not in TEST_IMPORTS:
                    yield Breach(
                        _rel(root, path),
                        node.lineno,
                        f"imports the test module {head}: move what it shares into tests/support/",
                    )
    for key in set(TEST_IMPORTS) - seen:
        yield Breach(_SELF, 1, f"no longer imported, remove from TEST_IMPORTS: {key}", stale=True)


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def check_sizes(root: Path) -> Iterator[Breach]:
    long_functions: set[str] = set()
    long_modules: set[str] = set()
    for folder in SIZED:
        for path in _python_files(root, folder):
            rel = _rel(root, path)
            if rel.startswith(GENERATED):
                continue
            text = path.read_text(encoding="utf-8")
            lines = len(text.splitlines())
            if lines > MAX_MODULE_LINES:
                long_modules.add(rel)
                if rel not in LONG_MODULES:
                    yield Breach(rel, 1, f"module of {lines} lines (at most {MAX_MODULE_LINES}): split it by concern")
            for name, node in _functions(ast.parse(text, rel)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - start + 1
                if length > MAX_FUNCTION_LINES:
                    key = f"{rel}::{name}"
                    long_functions.add(key)
                    if key not in LONG_FUNCTIONS:
                        yield Breach(
                            rel, start, f"{name} is {length} lines (at most {MAX_FUNCTION_LINES}): split it by phase"
                        )
    for key in set(LONG_FUNCTIONS) - long_functions:
        yield Breach(_SELF, 1, f"no longer long, remove from LONG_FUNCTIONS: {key}", stale=True)
    for key in set(LONG_MODULES) - long_modules:
        yield Breach(_SELF, 1, f"no longer long, remove from LONG_MODULES: {key}", stale=True)


def check(root: Path) -> list[Breach]:
    """Every breach of the four rules under `root`."""
    return [*check_circles(root), *check_test_imports(root), *check_sizes(root)]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    found = check(root)
    # A stale allow-list entry is a note, not a failure: the work that fixes a breach may land before or after the
    # commit that drops its entry (several people change the tree at once).
    for breach in found:
        print(f"note: {breach}" if breach.stale else breach)
    breaches = [b for b in found if not b.stale]
    if breaches:
        print(f"check_structure: {len(breaches)} breach(es) of the rules in {_SELF}", file=sys.stderr)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
