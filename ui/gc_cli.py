"""`asyncrl gc`: free the disk that ended campaigns' unpromoted runs hold (their weights and
checkpoints), by the retention policy of :mod:`flows.retention`. A dry run unless ``--apply``."""

from __future__ import annotations

import json

import typer

from ui.common import fail, open_registry, read_registry


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def gc(
    apply_: bool = typer.Option(False, "--apply", help="Delete (default: only list what would "
                                "be deleted)."),
    campaign: list[str] = typer.Option(None, "--campaign", help="Only this campaign id "
                                       "(repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan (and what was freed) "
                                 "as JSON."),
) -> None:
    """Delete the weights and checkpoints of runs nobody needs: the unpromoted runs (rejected
    candidates, re-run references, losing seeds) of campaigns that ended (finished or stopped)
    and that no live process owns. Promoted runs, running or crashed campaigns and every run's
    metrics, reports and plots are never touched. A dry run unless --apply."""
    from flows.retention import apply, plan
    from registry.db import CampaignOwnedError
    from registry.ownership import HEARTBEAT_TTL_S, CampaignLease
    from training.paths import state_path

    state = state_path()
    ids = list(campaign or []) or None
    db = read_registry()
    if ids:
        missing = [c for c in ids if db.get_campaign(c) is None]
        if missing:
            fail(f"no campaign {', '.join(map(repr, missing))} in the registry; "
                 "`asyncrl campaign list` shows them")
    gc_plan = plan(db, state, campaigns=ids, heartbeat_ttl_s=HEARTBEAT_TTL_S)
    db.close()
    freed, skipped = 0, []
    if apply_ and gc_plan.deletions:
        wdb = open_registry()
        try:
            for cid in dict.fromkeys(d.campaign_id for d in gc_plan.deletions):
                # hold the campaign while deleting: a resume started meanwhile is refused, and
                # one that started since the plan makes this campaign skipped
                try:
                    with CampaignLease(wdb, cid):
                        again = plan(wdb, state, campaigns=[cid], held=True)
                        freed += apply(d for d in again.deletions)
                except CampaignOwnedError as e:
                    skipped.append((cid, str(e)))
        finally:
            wdb.close()
    if as_json:
        typer.echo(json.dumps({
            "state_dir": str(state), "applied": apply_, "bytes": gc_plan.bytes,
            "freed_bytes": freed,
            "deletions": [{"campaign_id": d.campaign_id, "stage": d.stage,
                           "candidate": d.candidate, "path": str(d.path), "bytes": d.bytes}
                          for d in gc_plan.deletions],
            "kept": [{"campaign_id": c, "why": why} for c, why in gc_plan.kept],
            "skipped": [{"campaign_id": c, "why": why} for c, why in skipped],
            "unknown_dirs": [str(p) for p in gc_plan.unknown_dirs]}, indent=2))
        return
    for d in gc_plan.deletions:
        typer.echo(f"{_human(d.bytes):>9}  {d.campaign_id} {d.stage}/{d.candidate}: "
                   f"{d.path.relative_to(state) if d.path.is_relative_to(state) else d.path}")
    for cid, why in gc_plan.kept:
        typer.echo(f"kept: campaign {cid} ({why})")
    for cid, why in skipped:
        typer.echo(f"skipped: campaign {cid} ({why})")
    for p in gc_plan.unknown_dirs:
        typer.echo(f"not in the registry, left alone: {p}")
    total = _human(gc_plan.bytes)
    if not gc_plan.deletions:
        typer.echo(f"nothing to delete in {state}")
    elif apply_:
        typer.echo(f"freed {_human(freed)} of {total} in {state}")
    else:
        typer.echo(f"would free {total} in {state}; run `asyncrl gc --apply` to delete")


def register(app: typer.Typer) -> None:
    """Attach `gc` to the main CLI."""
    app.command("gc")(gc)
