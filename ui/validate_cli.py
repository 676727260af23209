"""`asyncrl validate FILE…`: check recipe and campaign files without running anything.

What it guarantees, for any bytes in any file:

- each file gets exactly one line: ``ok: PATH (...)`` on stdout, or ``error: PATH: <problem and
  fix>`` on stderr (or one entry of the ``--json`` list); the exit code is 0 when every file is
  valid, 1 otherwise — never a traceback, never a hang (files are bounded in size, nesting and
  expansion by :mod:`training.yamlfile`);
- a campaign is validated as ``asyncrl campaign launch`` validates it
  (:func:`registry.campaign.campaign_from_dict`): its base recipe and every candidate's recipe
  along the first-candidate chain are built (a stage's ``samples`` sized per candidate, its
  ``rerun_reference`` re-runs built too), and a stage listing a gate twice or a gate a
  candidate's recipe cannot feed (:func:`registry.gates.unmet_requirement`) is an error;
- it reads the files and a campaign's base recipe and nothing else: it writes nothing (no
  ``$ASYNCRL_HOME``), starts no service and imports no Prefect, MLflow or Ray. Recipes need no
  torch; a campaign's gates are checked by :mod:`registry.gates`, which imports torch today.

The kind is detected by content — a mapping with ``stages`` or ``base`` is a campaign, anything
else a recipe — or forced with ``--kind``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer


class Kind(enum.StrEnum):
    recipe = "recipe"
    campaign = "campaign"


@dataclass(frozen=True)
class Result:
    """One file's verdict (the ``--json`` entry)."""

    path: str
    kind: str | None  # None: the file could not be read, so its kind is unknown
    valid: bool
    error: str | None


class _FileError(ValueError):
    pass


def detect_kind(data: Any) -> Kind:
    """A mapping with ``stages`` or ``base`` is a campaign; anything else is read as a recipe."""
    if isinstance(data, Mapping) and ("stages" in data or "base" in data):
        return Kind.campaign
    return Kind.recipe


def _summary(kind: Kind, data: Any, path: Path) -> str:
    """What a valid file holds, for the ``ok:`` line (and the problem when it is not valid)."""
    if kind is Kind.campaign:
        from registry.campaign import campaign_from_dict

        campaign, _ = campaign_from_dict(data, str(path), path.parent)
        candidates = sum(len(s.candidates) for s in campaign.stages)
        return (f"campaign {campaign.name}: {len(campaign.stages)} stages, {candidates} "
                "candidates")
    from training.recipe import recipe_from_dict

    recipe = recipe_from_dict(data, str(path))
    return f"recipe {recipe.name}, hash {recipe.hash()}, mode {recipe.mode}"


def validate_file(path: Path, kind: Kind | None = None) -> tuple[Result, str]:
    """(the verdict on ``path``, the summary of a valid file). Reads; writes nothing."""
    from registry.campaign import CampaignError
    from training.recipe import RecipeError
    from training.yamlfile import escape_controls, read_yaml

    shown = escape_controls(str(path))
    what = kind.value if kind else "recipe or campaign"
    try:
        data = read_yaml(path, what, f"pass a {what} YAML file", _FileError)
    except _FileError as err:
        return Result(shown, kind and kind.value, False, str(err)), ""
    kind = kind or detect_kind(data)
    try:
        summary = _summary(kind, data, path)
    except (RecipeError, CampaignError) as err:
        msg = escape_controls(str(err))
        if not msg.startswith(shown):
            msg = f"{shown}: {msg}"
        return Result(shown, kind.value, False, msg), ""
    return Result(shown, kind.value, True, None), escape_controls(summary)


def validate(
    files: list[Path] = typer.Argument(..., metavar="FILE...", show_default=False,
                                       help="Recipe and campaign YAML files."),
    kind: Kind | None = typer.Option(None, "--kind", help="Read every FILE as this kind "
                                     "(default: by content; `stages` or `base` → campaign)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of {path, kind, valid, "
                                 "error} instead of one line per file."),
) -> None:
    """Check recipe and campaign files without running anything (for editors and CI): one line
    per file, exit code 0 when all are valid, 1 otherwise. Writes nothing, starts nothing."""
    results = []
    for path in files:
        result, summary = validate_file(path, kind)
        results.append(result)
        if as_json:
            continue
        if result.valid:
            typer.echo(f"ok: {result.path} ({summary})")
        else:
            typer.echo(f"error: {result.error}", err=True)
    if as_json:
        typer.echo(json.dumps([asdict(r) for r in results], indent=2))
    if not all(r.valid for r in results):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Attach `validate` to the main CLI."""
    app.command("validate")(validate)
