import subprocess
import sys


def test_algorithms_import_only_torch_and_numpy():
    """DESIGN.md: training.algorithms imports only torch/numpy (never Prefect, MLflow, Ray, SQL)."""
    code = ("import sys; from training.algorithms import *; "
            "print([m for m in ('prefect', 'mlflow', 'ray', 'sqlalchemy', 'alembic', 'pydantic', "
            "'typer', 'flows', 'registry', 'ui') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_schemas_and_gates_import_without_torch():
    """Validating a recipe or campaign and evaluating a gate is list arithmetic: no torch."""
    code = ("import sys, training.recipe, registry.campaign, registry.gates, "
            "training.algorithms.decision_tree; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_lazy_package_exports_what_its_submodules_define():
    import importlib

    import training.algorithms as algorithms

    for name, module in algorithms._WHERE.items():
        defined = getattr(importlib.import_module(f"training.algorithms.{module}"), name)
        assert getattr(algorithms, name) is defined
    assert algorithms.__all__ == sorted(algorithms._WHERE)
    try:
        algorithms.no_such_thing
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_the_cli_modules_import_no_private_name_of_each_other():
    """ui.cli and the command modules share ui.common; none reaches into another's private
    names (issue 15: the campaign_cli ↔ services_cli cycle)."""
    import ast
    from pathlib import Path

    ui = Path(__file__).resolve().parents[2] / "ui"
    for path in ui.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ui."):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, (path.name, node.module, private)
                if path.name in ("campaign_cli.py", "registry_cli.py", "gates_cli.py",
                                 "services_cli.py"):
                    assert node.module == "ui.common", (path.name, node.module)
