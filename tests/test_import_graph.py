"""The package's import graph has no cycle (issue 43 item 4): a module lower in the layering never imports one above
it, at module level or inside a function, so that no import runs only because another module has finished loading.

The graph is read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for every ``import b`` /
``from b import ...`` in ``a`` (``from p import m`` is an edge to the submodule ``p.m`` when it is one), relative
imports resolved, imports under ``if TYPE_CHECKING:`` left out (never run). A package's ``__init__`` is the module
``p``; importing ``p.m`` runs ``p`` first, but that implicit edge is left out (a package's ``__init__`` gathering
its submodules' names is how the package is read). The cycle that was here: ``integrations/transformers/adapter.py``
-> ``long_context.py`` -> ``adapter.py`` (the key asked the adapter for ``attention_modules``; the adapter called the
key's ``install``), with ``router_loss.py`` and ``delta.py`` on it too.
"""

from __future__ import annotations

import ast
import os

from tests.dist_utils import REPO

PACKAGE = "ds_mamba_spcp"


def _modules() -> dict[str, str]:
    """module name -> file, for every ``.py`` of the package."""
    found = {}
    root = os.path.join(REPO, PACKAGE)
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), REPO)[: -len(".py")].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join(rel)] = os.path.join(dirpath, name)
    return found


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node that can run (module level and inside functions, not under TYPE_CHECKING)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = os.path.basename(path) == "__init__.py"
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a non-module attribute path
                    target = target.rpartition(".")[0]
                if target.startswith(PACKAGE) and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first repeated at the end), or None."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_graph_reads_the_imports():
    """The reader sees module-level and function-level imports (a control for the test below)."""
    graph = import_graph()
    assert "ds_mamba_spcp.config" in graph["ds_mamba_spcp.integrations.transformers.adapter"]
    lc = graph["ds_mamba_spcp.integrations.transformers.long_context"]
    assert "ds_mamba_spcp.integrations.transformers.fused_loss" in lc  # imported inside install() only
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_package_import_graph_is_acyclic():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
