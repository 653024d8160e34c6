"""YAML documents from untrusted bytes, bounded: no alias bombs, no recursive aliases, clear errors.

``yaml.safe_load`` builds shared objects for aliases, so a 400-byte "billion laughs" file loads
quickly and then explodes in whatever walks it (printing, validating, copying). Each document's
node graph is measured before it is constructed: the number of nodes a full expansion of its
aliases would visit must stay under ``max_nodes``, and an alias inside its own anchor (a cycle) is
refused. libyaml's parser is used when PyYAML has it (several times faster, same results).
"""

from __future__ import annotations

from typing import Any

import yaml

from extproc.errors import SourceError

#: libyaml's parser with PyYAML's safe constructor when available (the same documents, faster).
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: Nodes one document may expand to (a 2,000-Service catalog has ~0.5M in all its documents).
MAX_NODES = 5_000_000


def load_documents(data: bytes, *, where: str, max_nodes: int = MAX_NODES) -> list[Any]:
    """Every document of a YAML stream, in order; SourceError says what is wrong and where."""
    loader = _Loader(data)
    try:
        documents: list[Any] = []
        while loader.check_node():
            node = loader.get_node()
            expanded_size(node, limit=max_nodes, where=f"{where}: document {len(documents) + 1}")
            documents.append(loader.construct_document(node))
        return documents
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        context = ""
        if exc.context and exc.context_mark and exc.problem:
            context = f" ({exc.context} at line {exc.context_mark.line + 1})"
        detail = exc.problem or exc.context
        raise SourceError(f"{where}: invalid YAML{at}: {detail}{context}") from exc
    except yaml.YAMLError as exc:
        raise SourceError(f"{where}: invalid YAML: {exc}") from exc
    finally:
        loader.dispose()


def expanded_size(root: yaml.Node, *, limit: int, where: str) -> int:
    """Nodes visited by expanding every alias under ``root``; SourceError past ``limit`` or on a cycle.

    Iterative and memoized per node, so it costs one visit per distinct node however deep the
    nesting or however many times an anchor is reused.
    """
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = _children(node)
        if not children_done:
            open_.add(key)
            stack.append((node, True))
            for child in children:
                if id(child) in open_:
                    raise SourceError(f"{where}: a YAML alias refers to a node containing it (recursive)")
                if id(child) not in sizes:
                    stack.append((child, False))
            continue
        open_.discard(key)
        size = 1 + sum(sizes[id(child)] for child in children)
        if size > limit:
            raise SourceError(
                f"{where}: its YAML aliases expand to more than {limit:,} nodes (an alias bomb?); refused"
            )
        sizes[key] = size
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []
