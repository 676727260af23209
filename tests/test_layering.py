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
                    "training.fileio", "training.algorithms.decision_tree",
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
