"""The package's import structure (issue 51), read from the source with `ast` (every import,
lazy ones inside functions included): the model's layers and models never reach up into the
runner, the engine or the server, and server/ and distributed/ have no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2] / "k3serve"


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_name(p): p for p in ROOT.rglob("*.py")}


def imports(module: str) -> set[str]:
    """The k3serve modules `module` imports anywhere in its body."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in MODULES}


def cycles(prefix: str) -> list[list[str]]:
    """Import circles among `prefix`'s modules."""
    return circles({m: {d for d in imports(m) if d.startswith(prefix)} for m in MODULES if m.startswith(prefix)})


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_layers_and_models_never_import_the_runner_engine_or_server():
    upward = ("k3serve.runner", "k3serve.engine", "k3serve.server")
    bad = {
        m: sorted(d for d in imports(m) if d.startswith(upward))
        for m in MODULES
        if m.startswith(("k3serve.layers", "k3serve.models"))
    }
    assert not {m: d for m, d in bad.items() if d}


def test_no_import_circles_in_server_or_distributed():
    assert cycles("k3serve.server") == []
    assert cycles("k3serve.distributed") == []


def test_the_checker_sees_a_circle():
    """The control: a circle is found (kv_transfer and the handlers were one before the split,
    issue 51, through a lazy import), and the imports it reads include the lazy ones."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "k3serve.distributed.ray_executor" in imports("k3serve.distributed.start")  # inside a function
    assert "k3serve.server.kv_transfer" in imports("k3serve.server.serving_chat")
    assert "k3serve.server.serving_chat" in imports("k3serve.server.kv_endpoints")
    assert imports("k3serve.server.kv_transfer").isdisjoint({"k3serve.server.serving_chat", "k3serve.server.runs"})
