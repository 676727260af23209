"""The `asyncrl` command line. Thin: every heavy import happens inside the command that needs it,
so `asyncrl --help` and `asyncrl --version` start instantly."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import typer

app = typer.Typer(
    name="asyncrl",
    help="Asynchronous RL post-training of LLMs: campaigns, stability gates, promotion, tracking.",
    no_args_is_help=True,
    add_completion=False,
)
algorithms_app = typer.Typer(help="Inspect the off-policy algorithms library.",
                             no_args_is_help=True)
app.add_typer(algorithms_app, name="algorithms")


def _fail(message: str) -> None:
    """A user error: one line on stderr naming the problem and the fix, exit code 1."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _version() -> str:
    try:
        return version("asyncrl")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"asyncrl {_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version_: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True,
        help="Print the asyncrl version and exit.",
    ),
) -> None:
    """asyncrl command line."""


@algorithms_app.command("list")
def list_algorithms() -> None:
    """List the registered policy losses, advantage estimators, KL estimators, rollout-correction
    presets and IS correction methods."""
    from rich.console import Console
    from rich.table import Table

    from training import algorithms as alg

    table = Table("family", "names")
    table.add_row("policy losses", ", ".join(alg.POLICY_LOSSES.names()))
    table.add_row("loss aggregation", ", ".join(alg.LOSS_AGG_MODES))
    table.add_row("advantage estimators", ", ".join(alg.ADVANTAGE_ESTIMATORS.names()))
    table.add_row("KL estimators", ", ".join(alg.KL_ESTIMATORS.names()))
    table.add_row("rollout-correction presets", ", ".join(alg.PRESETS))
    table.add_row("rejection-sampling modes", ", ".join(alg.RS_MODES))
    table.add_row("CompIS source methods", ", ".join(alg.CORRECTION_METHODS))
    Console().print(table)


@algorithms_app.command("diagnose")
def diagnose_metrics(
    metrics_file: Path = typer.Argument(
        ..., metavar="METRICS_JSON",
        help="JSON file: a flat {metric: value} dict, or {metric: [values, oldest first]}.",
    ),
) -> None:
    """Run seed 001's A–F decision tree on logged metrics and print causes, evidence and fixes."""
    from training.algorithms.decision_tree import diagnose

    try:
        data = json.loads(metrics_file.read_text())
    except (FileNotFoundError, IsADirectoryError):
        _fail(f"{metrics_file} is not a file; pass the path of a metrics JSON file")
    except json.JSONDecodeError as e:
        _fail(f"{metrics_file} is not valid JSON ({e.msg} at line {e.lineno}); fix the file")
    if not isinstance(data, dict):
        _fail(f"{metrics_file} must hold a JSON object {{metric: value}}")
    latest: dict[str, float] = {}
    history: dict[str, list[float]] = {}
    for key, value in data.items():
        if isinstance(value, list):
            if not value or not all(isinstance(v, int | float) for v in value):
                _fail(f"metric {key!r} must be a number or a non-empty list of numbers")
            history[key] = [float(v) for v in value]
            latest[key] = float(value[-1])
        elif isinstance(value, int | float):
            latest[key] = float(value)
        else:
            _fail(f"metric {key!r} must be a number or a non-empty list of numbers")
    result = diagnose(latest, history=history)
    if result.healthy:
        typer.echo("healthy: no meaningful drift (seed 001, step 1)")
    elif not result.findings:
        typer.echo("no cause matched")
    for f in result.findings:
        typer.echo(f"Cause {f.cause} — {f.title}")
        for ev in f.evidence:
            typer.echo(f"  evidence: {ev}")
        typer.echo(f"  fix: {f.fix}")
    if result.escalation:
        typer.echo(f"escalation: {result.escalation}")
    if result.missing:
        typer.echo(f"not measured: {', '.join(result.missing)}")


if __name__ == "__main__":
    app()
