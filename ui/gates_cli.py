"""`asyncrl gates RUN` and `asyncrl diagnose RUN`: a run's metric history — of asyncrl or of a
run trained elsewhere — judged by the stability gates, and seed 001's decision tree on it with the
fix as a recipe override."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from ui.common import fail


def _history(run: Path) -> list[dict[str, Any]]:
    from training.runtime.sinks import read_metrics

    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        fail(f"{run} has no metrics.jsonl; pass a run directory written by asyncrl train or a "
              "campaign")
    try:
        return read_metrics(path)
    except ValueError as e:
        fail(f"{path}: {e}")
    return []


def _evals(run: Path) -> list[Any]:
    """The per-prompt eval outcomes beside a run's metrics (``eval.jsonl``; [] if none), for
    paired eval comparisons."""
    from training.evals import EVAL_FILE, read_evals

    return read_evals((run if run.is_dir() else run.parent) / EVAL_FILE)


def _recorded_judgement(run: Path) -> tuple[dict[str, Any] | None, str]:
    """What a campaign judged ``run`` with (``judged_with`` of its gate_report.json), and a
    phrase naming it; ``(None, why)`` when the run has none."""
    report_path = (run if run.is_dir() else run.parent) / "gate_report.json"
    if not report_path.is_file():
        return None, "no gate_report.json: not judged by a campaign"
    try:
        judged = json.loads(report_path.read_text()).get("judged_with")
    except (OSError, ValueError, AttributeError):
        return None, f"{report_path} is unreadable"
    if not isinstance(judged, dict) or not isinstance(judged.get("gates"), list):
        return None, f"{report_path} records no gate configuration (written by an older asyncrl)"
    where = "/".join(str(judged[k]) for k in ("campaign_id", "stage", "candidate")
                     if judged.get(k))
    return judged, f"the gates, parameters and context campaign run {where or run} was judged with"


def _stage_gates(campaign_file: Path, stage_name: str | None,
                 reference_given: bool) -> tuple[list[dict[str, Any]], str, int]:
    """The gates (as specs) of ``stage_name`` in ``campaign_file``, a phrase naming them and
    the stage's candidate count; a one-line error for a bad file or an unknown stage."""
    from registry.campaign import CampaignError, load_campaign

    try:
        campaign, _ = load_campaign(campaign_file)
    except CampaignError as e:
        fail(str(e))
    names = [st.name for st in campaign.stages]
    if stage_name is None:
        fail(f"--campaign needs --stage: one of {', '.join(names)}")
    if stage_name not in names:
        fail(f"campaign {campaign.name!r} has no stage {stage_name!r}; stages: "
             f"{', '.join(names)}")
    stage = campaign.stage(stage_name)
    specs = [g.model_dump() for g in stage.gates]
    if not reference_given and any(g.get("relative_to") for g in specs):
        fail(f"stage {stage_name!r} judges relative to a reference stage: pass its promoted "
             "run with --reference REF_RUN")
    return specs, f"the gates of stage {stage_name!r} of {campaign_file}", len(stage.candidates)


def gates_cmd(
    run: Path = typer.Argument(..., metavar="RUN", help="Run directory (or its metrics.jsonl)."),
    reference: Path | None = typer.Option(None, "--reference", metavar="REF_RUN", help=(
        "Judge against this reference run (directory or metrics.jsonl), e.g. the sync "
        "baseline: every gate that can judge relatively does.")),
    campaign: Path | None = typer.Option(None, "--campaign", metavar="FILE", help=(
        "Take the gates and parameters of a stage of this campaign (with --stage).")),
    stage: str | None = typer.Option(None, "--stage", help="The stage of --campaign."),
    gate: list[str] = typer.Option([], "--gate", help="Only these gates."),
    defaults: bool = typer.Option(False, "--defaults", help="Judge with every gate at its "
                                  "default parameters instead of the configuration the run's "
                                  "campaign recorded."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Evaluate stability gates on a run's metric history — a run of asyncrl or one trained
    elsewhere and written to JSONL under the metric names (verl's and slime's names are read
    too). With --reference, against that run; with --campaign/--stage, with that stage's gates
    and parameters; else with the configuration its campaign recorded (gate_report.json), else
    (or with --defaults) every gate at its defaults. The first line says which. Exit 0 when
    every gate passes, 3 when one fails, 1 on bad input."""
    from registry.gates import GateContext, evaluate_gate, gate_names, summarize

    history = _history(run)
    ref_summary = summarize(_history(reference)) if reference is not None else None
    context: dict[str, Any] = {}
    references: dict[str, Any] = {}
    judged: dict[str, Any] | None = None
    if campaign is not None or stage is not None:
        if campaign is None:
            fail("--stage needs --campaign FILE")
        specs, used, n_candidates = _stage_gates(campaign, stage, reference is not None)
        specs = [g for g in specs if not gate or g["name"] in gate]
        context = {"candidates": n_candidates}
        used += f", against {reference}" if reference is not None else ""
    else:
        judged, source = ((None, "--defaults") if defaults or reference is not None
                          else _recorded_judgement(run))
        if judged is None:
            specs = [{"name": n, "params": {}, "relative_to": None}
                     for n in (gate or gate_names())]
            used = (f"every gate at its default parameters ({source})" if not gate
                    else f"default parameters ({source})")
            if reference is not None:
                used = ("every gate at its defaults" if not gate
                        else "default parameters") + f", against {reference}"
        else:
            specs = [g for g in judged["gates"] if not gate or g.get("name") in gate]
            specs += [{"name": n, "params": {}, "relative_to": None} for n in gate
                      if n not in {g.get("name") for g in specs}]  # asked for, not recorded
            used = f"{source}; --defaults for every gate at its defaults"
            references = judged.get("references") or {}
            context = judged.get("context") or {}
    recipe, _ = _run_recipe(run)
    if recipe is not None and "max_staleness" not in context:
        context = {**GateContext.of(recipe).model_dump(), **context}

    def ref_for(g: dict[str, Any]) -> Any:
        if ref_summary is not None:
            return ref_summary
        return references.get(g["relative_to"]) if g.get("relative_to") else None

    evals = _evals(run)
    ref_dirs = ((judged or {}).get("reference_runs") or {}) if reference is None else {}

    def ref_eval(g: dict[str, Any]) -> Any:
        where = reference if reference is not None else ref_dirs.get(g.get("relative_to") or "")
        outcomes = _evals(Path(where)) if where else []
        return outcomes[-1] if outcomes else None

    try:
        results = [evaluate_gate(g["name"], history, g.get("params") or {},
                                 reference=ref_for(g), context=context, evals=evals,
                                 reference_eval=ref_eval(g)).to_dict()
                   for g in specs]
    except (KeyError, ValueError) as e:
        fail(str(e.args[0]) if e.args else str(e))
    if as_json:
        typer.echo(json.dumps({"judged_with": used, "results": results}, indent=2))
    else:
        typer.echo(f"judged with {used}")
        for r in results:
            typer.echo(f"{'PASS' if r['passed'] else 'FAIL'} {r['name']}: {r['evidence']}")
    if not all(r["passed"] for r in results):
        raise typer.Exit(3)


def _run_recipe(run: Path) -> tuple[Any, str | None]:
    """The recipe a run trained with (its ``recipe.yaml``), or ``(None, why not)``."""
    from training.recipe import RecipeError, load_recipe

    path = (run if run.is_dir() else run.parent) / "recipe.yaml"
    if not path.is_file():
        return None, f"no {path.name} beside the metrics"
    try:
        return load_recipe(path), None
    except RecipeError as e:
        return None, str(e)


def _override_yaml(override: dict[str, Any]) -> str:
    """An override as the YAML a campaign candidate's ``overrides:`` takes (dotted keys kept:
    apply_overrides reads them)."""
    import yaml

    return yaml.safe_dump({"overrides": override}, sort_keys=False, default_flow_style=False,
                          allow_unicode=True).rstrip()


def diagnose_cmd(
    run: Path = typer.Argument(..., metavar="RUN", help="Run directory (or its metrics.jsonl)."),
    reference: Path | None = typer.Option(None, "--reference", metavar="REF_RUN", help=(
        "A healthy reference run (directory or metrics.jsonl), e.g. the campaign's sync "
        "baseline: the tree's thresholds measured on another stack are taken from it.")),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The decision tree of seed 001 on a run's metrics: each cause (A–F) with its evidence, the
    fix, and the fix as a recipe override — YAML ready to paste into a campaign candidate's
    ``overrides:``, tailored to and validated against the run's recipe.yaml when it has one.
    With ``--reference``, "rising", the staleness-KL level and the engine-agreement limits come
    from that run (lag: the run's recipe's staleness bound, 1 without a recipe or unbounded).
    Without it, a run a campaign judged against a reference is diagnosed with that reference
    and staleness bound (its gate_report.json), as the campaign's own diagnosis was."""
    from registry.gates import diagnosis_for, summarize

    history = _history(run)
    recipe, why = _run_recipe(run)
    bound = recipe.async_.staleness_bound if recipe is not None else None
    ref, source = None, None
    if reference is not None:
        ref, source = summarize(_history(reference)), str(reference)
    else:
        judged, _ = _recorded_judgement(run)
        recorded = (judged or {}).get("references")
        first = next(iter(recorded.items()), None) if isinstance(recorded, dict) else None
        if first is not None and isinstance(first[1], dict):  # else: not judged against one
            name, ref = first
            context = judged.get("context")
            recorded_bound = context.get("max_staleness") if isinstance(context, dict) else None
            bound = recorded_bound if isinstance(recorded_bound, int) else None
            source = f"stage {name}'s reference, as recorded in gate_report.json"
    diag = diagnosis_for(history, recipe, reference=ref, lag=1 if bound is None else bound)
    if as_json:
        out = {**diag.to_dict(), "recipe": "recipe.yaml" if recipe is not None else None}
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    typer.echo(diag.summary)
    if source is not None:
        typer.echo(f"(thresholds calibrated on {source})")
    if recipe is None:
        typer.echo(f"(overrides not tailored to the run's recipe: {why})")
    blocks = [*diag.findings, *([diag.unseparated] if diag.unseparated else [])]
    for f in blocks:
        head = f"cause {f.cause}" if f.cause != "unseparated" else "unseparated"
        typer.echo(f"{head}: {f.title}")
        for e in f.evidence:
            typer.echo(f"  evidence: {e}")
        typer.echo(f"  fix: {f.fix}")
        typer.echo("  prescribed override (paste into a campaign candidate):")
        for line in _override_yaml(f.override).splitlines():
            typer.echo(f"    {line}")
        if f.override_error:
            typer.echo(f"  warning: on this run's recipe the override does not load: "
                       f"{f.override_error}")
    if diag.escalation_text:
        typer.echo(f"escalation: {diag.escalation_text}")


def register(app: typer.Typer) -> None:
    """Attach ``asyncrl gates`` and ``asyncrl diagnose`` to the main CLI."""
    app.command("gates")(gates_cmd)
    app.command("diagnose")(diagnose_cmd)
