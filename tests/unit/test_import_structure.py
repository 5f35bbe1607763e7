"""The package layout is the architecture: what computes the model (layers/, models/) and the
step's data (forward/) never reach up into the runner, the engine or the server, at module
level or inside a function. Read from the source (ast), so a lazy import counts too."""

from __future__ import annotations

import ast
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


def test_the_step_data_imports_no_layer():
    assert not _violations("forward", ("k3serve.layers", "k3serve.models", "k3serve.spec")), "forward/ is below layers/"
