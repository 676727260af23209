"""DESIGN.md's import rules, checked on the source (AST, every import statement, including the
ones inside functions): imports point one way — ui → flows → (registry, training) and
registry → the torch-free schema modules of training; training never imports Prefect, MLflow,
SQLAlchemy or anything in flows/registry/ui; nothing imports the infrastructure folder
``platform/`` (it would shadow the standard library's ``platform``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("training", "flows", "registry", "ui")

# what each package may never import (top-level module names)
FORBIDDEN = {
    "training": {"prefect", "mlflow", "sqlalchemy", "alembic", "flows", "registry", "ui"},
    "registry": {"prefect", "mlflow", "flows", "ui"},
    "flows": {"ui"},
    "ui": set(),
}
# registry reads these parts of training only: schemas and small torch-free helpers
REGISTRY_MAY_USE = {"training.recipe", "training.yamlfile", "training.paths", "training.ownership",
                    "training.evals",
                    "training.fileio", "training.algorithms.decision_tree",
                    "training.sim.calibration",
                    "training.algorithms.registry"}


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def _sources(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "migrations" not in p.parts)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    bad = [(str(p.relative_to(ROOT)), m) for p in _sources(package) for m in _imports(p)
           if m.split(".")[0] in FORBIDDEN[package] | {"platform"} - _stdlib_platform(m)]
    assert bad == []


def _stdlib_platform(module: str) -> set[str]:
    # `import platform` (the standard library module) is fine; `platform.<x>` would be ours
    return {"platform"} if module == "platform" else set()


def test_registry_uses_only_the_schema_side_of_training():
    used = {m for p in _sources("registry") for m in _imports(p) if m.startswith("training")}
    assert used <= REGISTRY_MAY_USE, used - REGISTRY_MAY_USE


def test_the_infrastructure_folder_is_not_a_package():
    assert not list((ROOT / "platform").rglob("__init__.py"))


def _folder(module: str) -> str | None:
    """The folder a module belongs to, two levels deep (``training.engines``, ``flows``), for
    our packages only."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    return ".".join(parts[:2]) if parts[0] == "training" and len(parts) > 1 else parts[0]


def _folder_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("").parts
    return _folder(".".join(rel)) or ""


def _folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for p in _sources(package):
            src = _folder_of(p)
            for m in _imports(p):
                dst = _folder(m)
                # training/__init__-level modules (training.recipe, training.paths, …) are leaves
                if dst and dst != src and not (dst.startswith("training.") and
                                               (ROOT / (dst.replace(".", "/") + ".py")).is_file()):
                    graph.setdefault(src, set()).add(dst)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m):], m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_cycles_between_folders():
    """training's sub-packages (algorithms, engines, runtime, tasks), flows, registry and ui
    import each other one way only (inside functions too): e.g. training.tasks (prompts and
    rewards) never imports training.engines (the model), which uses the tasks."""
    graph = _folder_graph()
    assert "training.tasks" in graph.get("training.engines", set())  # the graph is real
    assert _cycle(graph) is None, " → ".join(_cycle(graph) or [])


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def _ui_module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for p in _sources("ui"):
        src = "ui." + p.stem
        for m in _imports(p):
            if m.startswith("ui.") and m != src:
                graph.setdefault(src, set()).add(m)
    return graph


def test_no_cycles_between_cli_modules():
    """ui's command modules share what they share through ui.common, never through each
    other's private names in both directions."""
    graph = _ui_module_graph()
    assert _cycle(graph) is None, " → ".join(_cycle(graph) or [])


def test_no_module_imports_another_module_s_private_names():
    """A helper two modules share is public in one small module (training.engines.ports,
    training.engines.retained, registry.records' converters), never a ``_name`` reached into
    from outside: a private name may change without warning, and importing it hides a shared
    dependency from the reader."""
    bad = []
    for package in PACKAGES:
        for p in _sources(package):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] in PACKAGES:
                    bad += [(str(p.relative_to(ROOT)), node.module, a.name) for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


def _module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for p in _sources(package):
            parts = p.relative_to(ROOT).with_suffix("").parts
            src = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for m in _imports(p):
                if m.split(".")[0] in PACKAGES and m != src:
                    graph.setdefault(src, set()).add(m)
    return graph


def test_no_cycles_between_modules():
    """No module imports itself back through others, inside functions included (the last one,
    embedded.launch → embedded.server → sglang.nccl_sync → embedded.launch for ``free_port``,
    ended when the helper moved to training.engines.ports)."""
    graph = _module_graph()
    assert "training.engines.ports" in graph.get("training.engines.sglang.nccl_sync", set())
    assert _cycle(graph) is None, " → ".join(_cycle(graph) or [])
