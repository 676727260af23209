"""`asyncrl simulate`: predict a recipe's step time and speed-up from a calibration (the
discrete-event model of :mod:`training.sim`), print the validation table of a calibration's
published figures, or write a calibration from a finished run directory.

Information only: nothing here gates or changes a run. Imports nothing heavy (no torch, Ray,
Prefect or MLflow)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ui.common import fail


def simulate(
    recipe_path: Path | None = typer.Argument(
        None, metavar="[RECIPE.yaml]", help="Recipe whose async knobs to simulate (overrides "
        "the calibration's knobs)."),
    calibration: Path | None = typer.Option(
        None, "--calibration", "-c", help="Calibration YAML (benchmarks/sim/*.yaml, or one "
        "written by --from-run)."),
    as_json: bool = typer.Option(False, "--json", help="Print the prediction (or the table) "
                                 "as JSON."),
    validate: bool = typer.Option(False, "--validate", help="Print the calibration's "
                                  "published/measured figures beside the predictions."),
    from_run: Path | None = typer.Option(
        None, "--from-run", help="Write a calibration from this finished run directory "
        "(recipe.yaml + metrics.jsonl) to --out."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Where --from-run writes the "
                                    "calibration YAML."),
) -> None:
    """Predict the step time and the speed-up over colocated sync of a recipe's async knobs on a
    calibrated set-up (a discrete-event model of rollouter, engines, buffer, trainer and weight
    sync). See docs/simulator.md."""
    from training.sim.calibration import CalibrationError

    if from_run is not None:
        _write_from_run(from_run, out)
        return
    if calibration is None:
        fail("pass --calibration FILE (e.g. benchmarks/sim/seed-002.yaml), or --from-run "
             "RUN_DIR -o FILE to write one")
    from training.sim.calibration import load_calibration
    from training.sim.predict import predict

    try:
        cal = load_calibration(calibration)
    except CalibrationError as e:
        fail(str(e))
    if validate:
        _print_table(cal, as_json)
        return
    recipe = None
    if recipe_path is not None:
        from training.recipe import RecipeError, load_recipe

        try:
            recipe = load_recipe(recipe_path)
        except RecipeError as e:
            fail(str(e))
    elif cal.knobs is None:
        fail(f"{calibration} carries no knobs; pass a RECIPE.yaml")
    pred = predict(recipe, cal)
    if as_json:
        typer.echo(json.dumps(pred.to_json(), indent=2))
        return
    typer.echo(f"predicted step time   {pred.step_time_s:.4g} s ({pred.mode})")
    typer.echo(f"colocated sync        {pred.colocated_step_time_s:.4g} s")
    typer.echo(f"sync on the split     {pred.sync_step_time_s:.4g} s")
    typer.echo(f"speed-up              {pred.speedup:.2f}x over colocated sync, "
               f"{pred.speedup_over_sync:.2f}x over sync on the split")
    typer.echo(f"why                   {pred.explanation}")


def _write_from_run(run_dir: Path, out: Path | None) -> None:
    import yaml

    from training.sim.calibration import CalibrationError
    from training.sim.fromrun import calibration_from_run

    if out is None:
        fail("--from-run needs --out FILE (where to write the calibration)")
    try:
        data = calibration_from_run(run_dir)
    except CalibrationError as e:
        fail(str(e))
    text = ("# written by `asyncrl simulate --from-run`; fields: docs/simulator.md\n"
            + yaml.safe_dump(data, sort_keys=False))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        fail(f"cannot write --out {out} ({e.strerror or e}); pass a writable file path")
    typer.echo(f"wrote {out}")


def _print_table(cal, as_json: bool) -> None:
    from training.sim.calibration import CalibrationError
    from training.sim.validate import validation_table

    try:
        rows = validation_table(cal)
    except CalibrationError as e:
        fail(str(e))
    if not rows:
        fail(f"calibration {cal.name} lists no figures to validate against")
    if as_json:
        typer.echo(json.dumps([{"name": r.figure.name, "metric": r.figure.metric,
                                "published": r.figure.value, "predicted": r.predicted,
                                "error": r.error, "reproduced": r.figure.reproduced,
                                "source": r.figure.source} for r in rows], indent=2))
        return
    typer.echo("| figure | metric | published/measured | predicted | error |")
    typer.echo("|---|---|---|---|---|")
    for r in rows:
        miss = "" if r.figure.reproduced else " (known miss)"
        typer.echo(f"| {r.figure.name} | {r.figure.metric} | {r.figure.value:.4g} | "
                   f"{r.predicted:.4g} | {r.error:+.1%}{miss} |")


def register(app: typer.Typer) -> None:
    """Attach `simulate` to the main CLI."""
    app.command("simulate")(simulate)
