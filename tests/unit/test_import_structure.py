"""The package layout is the architecture: what computes the model (layers/, models/) and the
step's data (forward/) never reach up into the runner, the engine or the server, at module
level or inside a function; server/ and distributed/ have no import circles (issue 51: the
kv_transfer/handler circle and the executor/ray_executor one were split; the collectives the
layers use are parallel/, the process orchestration distributed/). Read from the
source (ast), so a lazy import counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import k3serve

ROOT = Path(k3serve.__file__).parent
UPWARD = ("k3serve.runner", "k3serve.engine", "k3serve.server")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _violations(package: str, banned: tuple[str, ...]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)} imports {m}"
        for p in sorted((ROOT / package).rglob("*.py"))
        for m in sorted(_imports(p))
        if m.startswith(banned)
    ]


def test_layers_models_and_forward_never_import_runner_engine_or_server():
    bad = [v for pkg in ("layers", "models", "forward") for v in _violations(pkg, UPWARD)]
    assert not bad, bad


def test_the_collectives_the_layers_use_import_no_process_orchestration():
    """parallel/ (groups, collectives, sharding) sits below the model; distributed/ (the rank
    processes, executors, workers) above it: the layers reach only the former."""
    bad = _violations("parallel", UPWARD + ("k3serve.distributed", "k3serve.models", "k3serve.layers"))
    bad += [v for pkg in ("layers", "models", "forward") for v in _violations(pkg, ("k3serve.distributed",))]
    assert not bad, bad


def test_the_step_data_imports_no_layer():
    assert not _violations("forward", ("k3serve.layers", "k3serve.models", "k3serve.spec_decode")), (
        "forward/ is below layers/"
    )


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


def test_no_import_circles_in_server_distributed_engine_or_the_stage_code():
    assert cycles("k3serve.server") == []
    assert cycles("k3serve.distributed") == []
    assert cycles("k3serve.engine") == []  # build_core <-> LLMEngine was one (issue 65)
    assert cycles("k3serve.parallel") == [] and cycles("k3serve.config") == []


def test_the_checker_sees_a_circle():
    """The control: a circle is found (kv_transfer and the handlers were one before the split,
    issue 51, through a lazy import), and the imports it reads include the lazy ones."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "k3serve.distributed.ray_executor" in imports("k3serve.distributed.start")  # inside a function
    assert "k3serve.server.pd.kv_transfer" in imports("k3serve.server.openai.serving_chat")
    assert "k3serve.server.openai.serving_chat" in imports("k3serve.server.pd.endpoints")
    assert imports("k3serve.server.pd.kv_transfer").isdisjoint(
        {"k3serve.server.openai.serving_chat", "k3serve.server.openai.runs"}
    )


def test_the_engine_floor_stays_narrow():
    """engine/ (the core, its build, the output processor and the facades over them) reaches at
    most 10 other packages (it reached 18 before the executor seam), none of the model floor's
    (layers, models, kernels, backends, forward), and no class in it passes 300 lines."""
    packages = {
        m.split(".")[1]
        for p in (ROOT / "engine").rglob("*.py")
        for m in _imports(p)
        if m.startswith("k3serve.") and (ROOT / m.split(".")[1]).is_dir() and m.split(".")[1] != "engine"
    }
    assert len(packages) <= 10 and not packages & {"layers", "models", "kernels", "backends", "forward"}, packages
    long = [
        f"{p.name}:{node.name} {node.end_lineno - node.lineno + 1} lines"
        for p in (ROOT / "engine").rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300
    ]
    assert not long, long


def test_layers_never_import_backends_and_kernels_never_import_layers_or_backends():
    """How a layer runs is chosen from above (backends/ select, subclassing layers/backend.py's
    reference); the kernels below both know neither (issue 65: the backends / layers / kernels
    circle opened)."""
    bad = _violations("layers", ("k3serve.backends",))
    bad += _violations("kernels", ("k3serve.layers", "k3serve.backends", "k3serve.models"))
    assert not bad, bad


def package_graph(extra: tuple[tuple[str, str], ...] = ()) -> dict[str, set[str]]:
    """Every package of k3serve and every module at its root (sampling_params, outputs, cli) as
    one node; an arrow where a module of one imports a module of another, at module level or
    inside a function. The root package `k3serve` is left out: `from k3serve import kernels`
    names a module, not the root's contents, and its lazy `LLM` / `SamplingParams` are the public
    face. `extra` adds arrows (the control below)."""
    pkg = lambda m: m.split(".")[1] if m.count(".") else ""  # noqa: E731
    graph: dict[str, set[str]] = {pkg(m): set() for m in MODULES if pkg(m)}
    for m in MODULES:
        if pkg(m):
            graph[pkg(m)] |= {pkg(d) for d in imports(m) if pkg(d) and pkg(d) != pkg(m)}
    for a, b in extra:
        graph[a].add(b)
    return graph


def test_no_import_circle_between_packages():
    """No package reaches another that reaches it back (issue 65: config -> weights -> cache ->
    config closed through the hub-id lookup, now weights/hub.py `load_config`; scheduler ->
    sampling_params -> sampling -> scheduler through StructuredOutputs and the step outputs, now
    at the root beside SamplingParams)."""
    assert circles(package_graph()) == []


def test_a_reintroduced_upward_import_makes_a_circle():
    """The control: the two arrows issue 65 removed, put back one at a time, are each found."""
    assert circles(package_graph((("config", "weights"),))) == [["cache", "config", "weights"]]
    assert circles(package_graph((("sampling_params", "sampling"),))) == [["sampling", "sampling_params", "scheduler"]]


def test_value_types_and_configs_sit_low():
    """config/ takes paths (no hub, no spec_decode class); the root's value types import no
    package above them; scheduler/ and cache/ never import torch (pure bookkeeping)."""
    bad = _violations("config", ("k3serve.weights", "k3serve.spec_decode", "k3serve.engine", "torch"))
    for root_module in ("sampling_params.py", "outputs.py"):
        bad += [f"{root_module} imports {m}" for m in sorted(_imports(ROOT / root_module)) if m.startswith("k3serve")]
    bad += _violations("scheduler", ("torch",)) + _violations("cache", ("torch",))
    assert not bad, bad


def test_the_architecture_page_names_every_package():
    """docs/architecture.md's package map matches the tree: every package of k3serve (and every
    room of server/) is named there as `name/`, and every `name/` it names in the map exists."""
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    packages = {p.parent.relative_to(ROOT).as_posix() for p in ROOT.rglob("__init__.py") if p.parent != ROOT}
    missing = sorted(p for p in packages if f"`{p.rsplit('/', 1)[-1]}/`" not in page and f"`{p}/`" not in page)
    assert not missing, missing
    table = [line for line in page.splitlines() if line.startswith("| `")]
    named = {name for line in table for name in re.findall(r"`([a-z_]+)/`", line.split("|")[1])}
    assert named <= {p.rsplit("/", 1)[-1] for p in packages} | {"bench"}, named - {
        p.rsplit("/", 1)[-1] for p in packages
    }
