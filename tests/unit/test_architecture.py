"""The layout rules of docs/architecture.md, checked on the source (no services, no imports).

* no import cycle inside ``payment_worker``, function-level imports included;
* runtime code never imports ``payment_worker.dev`` (only the command line, the composition
  root of the dev commands, may);
* pure domain code imports nothing that does I/O;
* no per-process cache outside ``runtime.py``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "payment_worker"
# the only modules pure domain code may use from the package: itself, the errors, and the
# gateway's answer classes (a pure decision table)
DOMAIN_MAY_IMPORT = (
    "payment_worker.domain",
    "payment_worker.errors",
    "payment_worker.gateway.outcomes",
)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {
        _module_name(p): p
        for p in PKG.rglob("*.py")
        if "migrations" not in p.relative_to(PKG).parts
    }


MODULES = _sources()
# the command line (every module of the package) wires the dev commands (demo, gateway-sim)
# to the runtime
COMPOSITION_ROOTS = {
    n for n in MODULES if n == "payment_worker.cli" or n.startswith("payment_worker.cli.")
}


def _imports(name: str, path: Path) -> Iterator[str]:
    """Every payment_worker module ``name`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # "from pkg import sub" imports the submodule when there is one
                sub = f"{base}.{alias.name}"
                yield sub if sub in MODULES else base


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = {d for d in _imports(name, path) if d in MODULES and d != name}
        # importing a package's own __init__ from inside it is how Python works, not a cycle
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    # the checker itself: a function-level import back is a cycle too
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_runtime_code_never_imports_dev() -> None:
    offenders = {
        name: sorted(d for d in deps if d.startswith("payment_worker.dev"))
        for name, deps in _graph().items()
        if not name.startswith("payment_worker.dev") and name not in COMPOSITION_ROOTS
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_domain_is_pure() -> None:
    offenders = {}
    for name, path in MODULES.items():
        if not name.startswith("payment_worker.domain"):
            continue
        bad = [
            d
            for d in _imports(name, path)
            if d.startswith("payment_worker") and not d.startswith(DOMAIN_MAY_IMPORT)
        ]
        bad += [
            d
            for d in _imports(name, path)
            if d.split(".")[0] in ("redis", "sqlalchemy", "psycopg", "httpx", "celery")
        ]
        if bad:
            offenders[name] = bad
    assert offenders == {}


_CACHE_MARKERS = ("lru_cache", "functools.cache", "WeakKeyDictionary", "WeakValueDictionary")


def _module_level_mutables(path: Path) -> list[str]:
    """Module-level names bound to a mutable container: a cache in all but name."""
    found = []
    for node in ast.parse(path.read_text()).body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        mutable = isinstance(value, ast.Dict | ast.List | ast.Set) or (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict")
        )
        # an empty container filled at run time; a literal table of constants is data
        empty = mutable and not (
            isinstance(value, ast.Dict | ast.List | ast.Set)
            and (getattr(value, "keys", None) or getattr(value, "elts", None))
        )
        if empty:
            found += [ast.unparse(t) for t in targets]
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_per_process_cache_outside_the_runtime(name: str) -> None:
    if name == "payment_worker.runtime":
        return
    text = MODULES[name].read_text()
    assert not [m for m in _CACHE_MARKERS if m in text], name
    assert _module_level_mutables(MODULES[name]) == [], name


_SQL = re.compile(
    r"\b(SELECT\s.+\sFROM|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM"
    r"|CREATE\s+(TABLE|DATABASE|INDEX))\b",
    re.I | re.S,
)


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes: prose about SQL is fine, statements are not."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_sql_lives_in_db_only(name: str) -> None:
    if name.startswith("payment_worker.db"):
        return
    tree = ast.parse(MODULES[name].read_text())
    docs = _docstrings(tree)
    statements = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docs
        and _SQL.search(node.value)
    ]
    assert statements == [], name
