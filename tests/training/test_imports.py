import subprocess
import sys


def test_algorithms_import_only_torch_and_numpy():
    """DESIGN.md: training.algorithms imports only torch/numpy (never Prefect, MLflow, Ray, SQL)."""
    code = ("import sys, training.algorithms; "
            "print([m for m in ('prefect', 'mlflow', 'ray', 'sqlalchemy', 'alembic', 'pydantic', "
            "'typer', 'flows', 'registry', 'ui') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
