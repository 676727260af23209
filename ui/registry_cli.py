"""`asyncrl registry …`: the recipe registry's promoted recipes and checkpoints — list and show
them, promote a recipe or retire a promotion by hand (recorded with who and why)."""

from __future__ import annotations

import json
import os

import typer

from ui.common import fail, open_registry, read_registry, resolve_recipe_hash

registry_app = typer.Typer(help="The recipe registry: promoted recipes and checkpoints.",
                           no_args_is_help=True)


@registry_app.command("list")
def registry_list(campaign_id: str | None = typer.Option(None, "--campaign"),
                  all_: bool = typer.Option(False, "--all", help="Include retired ones."),
                  as_json: bool = typer.Option(False, "--json")) -> None:
    """Promoted recipes (active ones unless --all)."""
    db = read_registry()
    rows = db.promotions(campaign_id=campaign_id, status=None if all_ else "active")
    db.close()
    if as_json:
        typer.echo(json.dumps([p.to_dict() for p in rows], indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table()
    for c in ("id", "campaign", "stage", "candidate", "recipe", "status", "by", "reason"):
        t.add_column(c)
    for p in rows:
        t.add_row(str(p.id), p.campaign_id or "—", p.stage or "—", p.candidate,
                  p.recipe_hash, p.status, p.actor, (p.reason or "")[:60])
    Console().print(t)


@registry_app.command("show")
def registry_show(recipe_hash: str = typer.Argument(..., help="Recipe hash, or a prefix of it "
                                                   "(4 or more characters) that only it has.")
                  ) -> None:
    """Print a registered recipe (YAML) and its promotions."""
    db = read_registry()
    recipe_hash = resolve_recipe_hash(db, recipe_hash)
    row = db.get_recipe(recipe_hash)
    promos = [p for p in db.promotions() if p.recipe_hash == recipe_hash]
    db.close()
    if row is None:
        fail(f"no recipe {recipe_hash!r} in the registry; `asyncrl registry list` shows the "
              "promoted ones")
    typer.echo(f"# recipe {recipe_hash} ({row.name})")
    typer.echo(row.yaml)
    for p in promos:
        typer.echo(f"# promoted: {p.campaign_id}/{p.stage} {p.candidate} "
                   f"({p.status}, by {p.actor}: {p.reason})")


@registry_app.command("promote")
def registry_promote(
    recipe_hash: str = typer.Argument(..., help="Recipe hash (it must be registered), or a "
                                      "prefix of it (4 or more characters) that only it has."),
    reason: str = typer.Option(..., "--reason", help="Why (recorded)."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help="HF checkpoint dir."),
    campaign_id: str | None = typer.Option(None, "--campaign"),
    stage: str | None = typer.Option(None, "--stage"),
    candidate: str = typer.Option("manual", "--candidate"),
    actor: str | None = typer.Option(None, "--by", help="Who (default: $USER)."),
) -> None:
    """Promote a recipe by hand (a person's decision, recorded with who and why)."""
    from registry.db import RegistryError

    db = open_registry()
    recipe_hash = resolve_recipe_hash(db, recipe_hash)
    try:
        pid = db.promote(recipe_hash=recipe_hash, candidate=candidate, checkpoint=checkpoint,
                         campaign_id=campaign_id, stage=stage,
                         actor=actor or os.environ.get("USER", "user"), reason=reason)
    except RegistryError as e:
        fail(str(e))
    db.close()
    typer.echo(f"promotion {pid}: {recipe_hash}")


@registry_app.command("retire")
def registry_retire(promotion_id: int = typer.Argument(..., help="Promotion id."),
                    reason: str = typer.Option(..., "--reason", help="Why (recorded)."),
                    actor: str | None = typer.Option(None, "--by")) -> None:
    """Retire a promotion (kept in the history with who and why)."""
    from registry.db import RegistryError

    db = open_registry()
    try:
        db.retire(promotion_id, actor=actor or os.environ.get("USER", "user"), reason=reason)
    except RegistryError as e:
        fail(str(e))
    db.close()
    typer.echo(f"promotion {promotion_id} retired")


def register(app: typer.Typer) -> None:
    """Attach ``asyncrl registry`` to the main CLI."""
    app.add_typer(registry_app, name="registry")
