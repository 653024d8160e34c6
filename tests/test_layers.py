"""The package's layering, checked on every import statement wherever it stands (function bodies
and ``TYPE_CHECKING`` blocks included); ``from pkg import mod`` counts as an import of ``pkg.mod``.

Data flows one way (DESIGN.md): sources -> catalog <- engines / kvindex; protocol -> control ->
scheduling -> state. Each package may import only the packages listed for it below (and itself);
the adapters to ``grpc``, ``zmq`` and ``kubernetes`` live in one package each; the reconciler never
reaches into the request path. A new package must be placed here before it can be imported anywhere.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "extproc"
#: The benchmarks: covered by the cycle check (their scripts import siblings by bare name).
BENCH = REPO / "bench"

#: Modules at the package root that everything may use: identifiers, host:port strings, errors,
#: settings and the flags that set them, the request type, logging/metrics helpers, task, HTTP and
#: watched-file helpers, the admin HTTP surface.
CORE = frozenset(
    {
        "types",
        "addresses",
        "errors",
        "tasks",
        "settings",
        "flags",
        "openai",
        "telemetry",
        "fetch",
        "files",
        "admin",
    }
)

#: Package -> the packages it may import (besides itself and CORE).
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "catalog": frozenset(),
    "kube": frozenset(),
    "tokenize": frozenset(),
    "kvindex": frozenset({"catalog"}),
    "sources": frozenset({"catalog", "kube"}),
    "control": frozenset({"catalog", "scheduling"}),
    "scheduling": frozenset({"catalog", "kvindex", "tokenize"}),
    "engines": frozenset({"catalog", "scheduling", "tokenize"}),
    "protocol": frozenset({"control", "scheduling", "pb"}),
    "serve": frozenset(
        {
            "catalog",
            "control",
            "engines",
            "kube",
            "kvindex",
            "peers",
            "protocol",
            "scheduling",
            "sources",
            "tokenize",
        }
    ),
    "peers": frozenset({"control", "kube"}),
    "reconcile": frozenset({"catalog", "kube"}),
    "sim": frozenset({"tokenize"}),
    "gateway": frozenset(),
    "demo": frozenset({"gateway", "serve", "sim", "tokenize"}),
    "cli": frozenset({"demo", "peers", "reconcile", "serve", "sim"}),
    "__init__": frozenset(),
    "__main__": frozenset({"cli"}),
}

#: Third-party adapters: the library -> the only places that may import it.
ADAPTERS: dict[str, frozenset[str]] = {
    "grpc": frozenset({"protocol", "pb"}),
    "grpc_health": frozenset({"protocol"}),
    "zmq": frozenset(
        {
            "kvindex/subscriber.py",
            "kvindex/subscriptions.py",
            "peers/curve.py",
            "peers/sync.py",
            "sim/kv_publisher.py",
        }
    ),
    "kubernetes": frozenset({"kube"}),
}


def _owner(path: Path) -> str:
    """The layer a module belongs to: its package, or ``core`` for the root's shared modules."""
    rel = path.relative_to(ROOT)
    if len(rel.parts) > 1:
        return rel.parts[0]
    return "core" if rel.stem in CORE else rel.stem


def _is_module(dotted: str, root: Path = REPO) -> bool:
    """``extproc.x.y`` or ``bench.x.y`` names a module or package under ``root``."""
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or path.is_dir()


def _imports(path: Path, root: Path = REPO) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in a module, wherever it stands (``ast.walk`` visits
    function bodies and ``if TYPE_CHECKING:`` blocks alike). ``from pkg import mod`` yields
    ``pkg.mod`` when ``mod`` is a module, else ``pkg``; relative imports are made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(root).parent.parts if path.is_relative_to(root) else ()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            modules = [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}", root)]
            if len(modules) < len(node.names) and base:
                yield node.lineno, base
            for module in modules:
                yield node.lineno, module


def _target(module: str) -> str | None:
    """The layer an ``extproc.*`` import lands in (None for the bare package)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    name = parts[1]
    if not (ROOT / name).is_dir() and not (ROOT / f"{name}.py").is_file():
        return "core"  # a name the package itself defines (``__version__``)
    return "core" if name in CORE else name


MODULES = sorted(p for p in ROOT.rglob("*.py") if "pb" not in p.relative_to(ROOT).parts)


def test_every_module_has_a_layer() -> None:
    """A module outside every known layer would escape the rules below."""
    assert MODULES
    unknown = sorted({_owner(p) for p in MODULES} - set(ALLOWED))
    assert not unknown, f"place these in tests/test_layers.py ALLOWED: {unknown}"


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_imports_follow_the_layers(path: Path) -> None:
    """No upward or sideways import: each package reaches only the layers listed for it."""
    owner = _owner(path)
    allowed = ALLOWED[owner] | {owner, "core"}
    wrong = [
        f"line {line}: {module}"
        for line, module in _imports(path)
        if module.startswith("extproc.") and (layer := _target(module)) is not None and layer not in allowed
    ]
    assert not wrong, f"{path.relative_to(ROOT)} ({owner}) may import only {sorted(allowed)}: {wrong}"


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_adapters_import_their_library_alone(path: Path) -> None:
    """grpc only in the Envoy protocol package, zmq only in the KV-event sockets, kubernetes in kube."""
    rel = path.relative_to(ROOT)
    places = {str(rel), rel.parts[0]}
    wrong = [
        f"line {line}: {module}"
        for line, module in _imports(path)
        if (library := module.split(".")[0]) in ADAPTERS and not places & ADAPTERS[library]
    ]
    assert not wrong, f"{rel} imports an adapter's library: {wrong}"


def _module_name(path: Path, root: Path = REPO) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


#: Every module whose imports the cycle check follows: the package and the benchmarks.
GRAPHED = MODULES + sorted(BENCH.rglob("*.py"))


def _resolve(module: str, names: dict[str, Path]) -> str | None:
    """The graphed module an import lands in: itself, or a benchmark's sibling imported by bare
    name (``from grpc_load import ...``, with ``bench/`` on the path)."""
    if module in names:
        return module
    return f"bench.{module}" if f"bench.{module}" in names else None


def import_graph(paths: list[Path], root: Path = REPO) -> dict[str, list[str]]:
    """Module -> the graphed modules it imports."""
    names = {_module_name(p, root): p for p in paths}
    return {
        name: sorted(
            {r for _, m in _imports(path, root) if (r := _resolve(m, names)) is not None and r != name}
        )
        for name, path in names.items()
    }


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)) is not None:
            return cycle
    return None


def test_no_import_cycles() -> None:
    """Modules of ``extproc`` and ``bench`` import each other one way only (a cycle through a
    function body or behind TYPE_CHECKING counts too)."""
    cycle = find_cycle(import_graph(GRAPHED))
    assert cycle is None, " -> ".join(cycle)


def test_a_violation_is_caught(tmp_path: Path) -> None:
    """The walk sees plain, ``from`` and ``TYPE_CHECKING`` imports and maps them to layers."""
    module = tmp_path / "m.py"
    module.write_text(
        "import zmq\nfrom typing import TYPE_CHECKING\nfrom extproc.serve.app import Server\n"
        "if TYPE_CHECKING:\n    from extproc import openai\n"
    )
    found = list(_imports(module))
    assert (1, "zmq") in found and (3, "extproc.serve.app") in found and (5, "extproc.openai") in found
    assert [_target(m) for _, m in found if m.startswith("extproc.")] == ["serve", "core"]


def test_a_module_imported_from_its_package_counts_as_that_module(tmp_path: Path) -> None:
    """``from extproc.sim import sglang`` is an import of ``extproc.sim.sglang``, not of the package,
    and an import inside a function body counts."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from extproc.sim import sglang, DEFAULT_NAME\n")
    found = {m for _, m in _imports(module)}
    assert "extproc.sim.sglang" in found


def test_a_cycle_through_a_function_body_is_found(tmp_path: Path) -> None:
    """Two modules importing each other, one side inside a function (as the replay's two runners
    once did), make a cycle."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("from pkg.a import f\n")
    graph = import_graph(sorted(package.glob("*.py")), root=tmp_path)
    assert find_cycle(graph) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


def test_the_reconciler_never_reaches_the_request_path() -> None:
    """The status sidecar reads serve over HTTP; it imports none of serve's request-path packages."""
    request_path = {"protocol", "control", "serve", "scheduling", "kvindex", "tokenize", "engines"}
    assert not request_path & ALLOWED["reconcile"]
