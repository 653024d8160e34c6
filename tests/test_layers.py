"""The package's layering, checked on every import statement (``TYPE_CHECKING`` ones included).

Data flows one way (DESIGN.md): sources -> catalog <- engines / kvindex; server -> scheduling ->
state. Each package may import only the packages listed for it below (and itself); the adapters to
``grpc``, ``zmq`` and ``kubernetes`` live in one package each; the reconciler never reaches into
the request path. A new package must be placed here before it can be imported anywhere.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "extproc"

#: Modules at the package root that everything may use: identifiers, errors, settings, the request
#: type, logging/metrics helpers, task and HTTP helpers, the admin HTTP surface.
CORE = frozenset({"types", "errors", "tasks", "settings", "openai", "telemetry", "fetch", "admin"})

#: Package -> the packages it may import (besides itself and CORE).
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "catalog": frozenset(),
    "kube": frozenset(),
    "tokenize": frozenset(),
    "kvindex": frozenset({"catalog"}),
    "sources": frozenset({"catalog", "kube"}),
    "scheduling": frozenset({"catalog", "kvindex", "tokenize"}),
    "engines": frozenset({"catalog", "scheduling", "tokenize"}),
    "server": frozenset({"scheduling", "pb"}),
    "serve": frozenset({"catalog", "engines", "kvindex", "scheduling", "server", "sources", "tokenize"}),
    "reconcile": frozenset({"catalog", "kube"}),
    "sim": frozenset({"tokenize"}),
    "gateway": frozenset(),
    "demo": frozenset({"gateway", "serve", "sim", "tokenize"}),
    "cli": frozenset({"demo", "reconcile", "scheduling", "serve", "sim", "tokenize"}),
    "__init__": frozenset(),
    "__main__": frozenset({"cli"}),
}

#: Third-party adapters: the library -> the only places that may import it.
ADAPTERS: dict[str, frozenset[str]] = {
    "grpc": frozenset({"server", "pb"}),
    "grpc_health": frozenset({"server"}),
    "zmq": frozenset({"kvindex/subscriber.py", "kvindex/subscriptions.py", "sim/kv_publisher.py"}),
    "kubernetes": frozenset({"kube"}),
}


def _owner(path: Path) -> str:
    """The layer a module belongs to: its package, or ``core`` for the root's shared modules."""
    rel = path.relative_to(ROOT)
    if len(rel.parts) > 1:
        return rel.parts[0]
    return "core" if rel.stem in CORE else rel.stem


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every absolute import in a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            if node.module == "extproc":
                for alias in node.names:
                    yield node.lineno, f"extproc.{alias.name}"


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


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def test_no_import_cycles() -> None:
    """Modules import each other one way only (a cycle hidden behind TYPE_CHECKING counts too)."""
    names = {_module_name(p): p for p in MODULES}
    graph = {
        name: sorted({m for _, m in _imports(path) if m in names and m != name})
        for name, path in names.items()
    }
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
        if name not in state:
            cycle = visit(name)
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


def test_the_reconciler_never_reaches_the_request_path() -> None:
    """The status sidecar reads serve over HTTP; it imports none of serve's request-path packages."""
    request_path = {"server", "serve", "scheduling", "kvindex", "tokenize", "engines"}
    assert not request_path & ALLOWED["reconcile"]
