"""`asyncrl campaign …`, `asyncrl registry …`, `asyncrl gates`, `asyncrl diagnose`,
`asyncrl schema campaign`: the platform commands (lazy imports, one-line errors)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ui.common import (
    DEFAULT_PREFECT_PORT,
    HOST,
    answers,
    fail,
    require_state_dir,
    up_prefect_api,
)

if TYPE_CHECKING:
    from registry.campaign import Campaign
    from registry.db import OwnerRecord, RegistryDB
    from training.recipe import Recipe

campaign_app = typer.Typer(help="Run staged campaigns (Prefect flows) and inspect them.",
                           no_args_is_help=True)
registry_app = typer.Typer(help="The recipe registry: promoted recipes and checkpoints.",
                           no_args_is_help=True)


def _db(url: str | None = None):
    from registry.db import RegistryDB, RegistryError

    try:
        return RegistryDB(url)
    except RegistryError as e:
        fail(str(e))


class _NoRegistry:
    """The registry a read sees before the first campaign created it: nothing recorded. (The
    read commands call only these; any other call is a bug that fails loudly.)"""

    def list_campaigns(self) -> list:
        return []

    def get_campaign(self, campaign_id: str) -> None:
        return None

    def get_recipe(self, recipe_hash: str) -> None:
        return None

    def promotions(self, **_filters: Any) -> list:
        return []

    def close(self) -> None:
        pass


def _read_db():
    """The registry for a command that only reads. One that does not exist yet is not created
    (a new or read-only state directory simply has no campaigns), and the default SQLite one at
    the newest schema is read without SQLAlchemy (registry.sqlite_reader): `campaign status`
    stays fast."""
    from registry.records import RegistryError
    from registry.sqlite_reader import open_reader

    try:
        db = open_reader()
    except RegistryError as e:
        fail(str(e))
    return _NoRegistry() if db is None else db


# --- campaign -----------------------------------------------------------------------------------


def _live_table(state: dict[tuple[str, str], dict[str, Any]]):
    from rich.table import Table

    t = Table(title="campaign", expand=False)
    for col in ("stage", "candidate", "state", "reward", "eval", "|Δlogp|", "staleness",
                "failed gates"):
        t.add_column(col)
    for (stage, cand), row in state.items():
        s = row.get("summary") or {}

        def f(key: str, s: dict = s) -> str:
            v = s.get(key)
            return "—" if v is None else f"{v:.3g}"

        failed = ", ".join(g["name"] for g in row.get("gates", []) if not g["passed"])
        t.add_row(stage, cand, row.get("status", ""), f("rollout/reward_mean"),
                  f("eval/reward_mean"), f("mismatch/train_rollout/logprob_abs_diff/mean"),
                  f("async/staleness/mean"), failed)
    return t


def _run_flow(path: Path, campaign_id: str, as_json: bool) -> None:
    """Record the campaign, take its ownership (a second launch/resume of it is refused in one
    line naming the owner, before Prefect starts) and run its flow in this process."""
    require_state_dir()
    up_api = None
    if not os.environ.get("PREFECT_API_URL", "").strip():
        up_api = up_prefect_api()
        if up_api:  # before Prefect is imported: it reads its settings once
            os.environ["PREFECT_API_URL"] = up_api
    from flows import campaign as cflow  # configures Prefect before importing it
    from registry.campaign import CampaignError, load_campaign
    from registry.db import RegistryError
    from registry.ownership import CampaignLease

    try:
        campaign, base = load_campaign(path)
    except CampaignError as e:
        fail(str(e))
    db = _db()
    try:
        cflow.record_campaign(db, campaign, base, path, campaign_id)
        with CampaignLease(db, campaign_id):
            _follow_flow(cflow, path, campaign_id, as_json, up_api,
                         _first_stage_recipes(campaign, base, db, campaign_id))
    except RegistryError as e:  # CampaignOwnedError: another live process runs it
        fail(str(e))
    finally:
        db.close()


def _first_stage_recipes(campaign: Campaign, base: dict[str, Any], db: RegistryDB,
                         campaign_id: str) -> list[Recipe]:
    """The recipes the campaign's first stage trains when this run will train it (no earlier
    run of the campaign promoted it): :func:`_start` builds their starting checkpoints, warm
    starts included, before the services start."""
    from registry.campaign import stage_recipes

    first = campaign.stages[0]
    if db.promoted(campaign_id, first.name) is not None:
        return []
    return [recipe for _, recipe in stage_recipes(campaign, first, base, {}).candidates]


def _start(recipes: list[Recipe], report: Callable[[str | None], None]) -> None:
    """Build the starting checkpoints of ``recipes`` (:func:`initial_checkpoint`: the cached
    warm start, trained the first time — minutes on a laptop — with ``report(text)`` showing
    its progress, e.g. ``"train 120/700"``, and ``report(None)`` when done), then start the services
    (:func:`flows.startup.start_services`). The first stage's runs find the checkpoints cached.

    One after the other, not side by side: measured on the 2-core machine (README command 1 in
    a new state directory), building the warm start while the services started made the first
    run slower, 373 s vs 330 s — the services' start-up is CPU work of their own (Prefect's
    migrations, Ray's processes), and the warm start's two torch threads lose more than that
    when they share the cores. Built first, a bad checkpoint or backend fails before anything
    starts."""
    from flows.startup import start_services
    from training.runtime.run import initial_checkpoint

    def on_warm(ev: Any) -> None:
        if ev.total:
            report(f"{ev.phase} {ev.step}/{ev.total}")

    try:
        for recipe in recipes:
            initial_checkpoint(recipe, progress=on_warm)
    finally:
        report(None)
    start_services()  # Prefect's temporary API, MLflow's store and Ray, side by side


def _follow_flow(cflow: Any, path: Path, campaign_id: str, as_json: bool,
                 up_api: str | None = None, first: list[Recipe] | None = None) -> None:
    from rich.console import Console
    from rich.live import Live

    from flows.events import CampaignEvent, CandidateEvent, PromotedEvent
    from registry.campaign import CampaignError
    from registry.db import RegistryError
    from training.recipe import RecipeError
    from training.runtime.run import RunError

    console = Console(stderr=as_json)
    state: dict[tuple[str, str], dict[str, Any]] = {}

    with Live(_live_table({}), console=console, refresh_per_second=4,
              transient=False) as live:
        def on_event(ev: CampaignEvent) -> None:
            if isinstance(ev, CandidateEvent):
                row = state.setdefault((ev.stage, ev.candidate), {})
                row["status"] = ev.status
                row.update({k: v for k, v in (("summary", ev.summary), ("gates", ev.gates))
                            if v is not None})
            elif isinstance(ev, PromotedEvent):
                state.setdefault((ev.stage, ev.candidate), {})["status"] = "promoted"
            elif ev.earlier:  # a StageEvent: promoted by an earlier run of this campaign
                state.setdefault((ev.stage, "(earlier)"), {})["status"] = ev.shown
            live.update(_live_table(state))

        cflow.EVENT_LISTENERS.append(on_event)
        try:
            if up_api:
                console.print(f"flow run on the Prefect server of `asyncrl up` ({up_api}); "
                              "keep it up until the campaign ends")
            def report(text: str | None) -> None:
                if text is None:
                    state.pop(("(warm start)", ""), None)
                else:
                    state[("(warm start)", "")] = {"status": text}
                live.update(_live_table(state))

            _start(first or [], report)
            # a stopped campaign ends its flow run Failed (flows.campaign.flow_result): read
            # the outcome from the state; an exception the flow raised is raised again here
            flow_state = cflow.campaign_flow(str(path), campaign_id, return_state=True)
            out = flow_state.result(raise_on_failure=False)
            if isinstance(out, BaseException):
                raise out
        except (CampaignError, RecipeError, RunError, RegistryError) as e:
            live.stop()
            fail(f"{e} (campaign {campaign_id}; resume with: asyncrl campaign resume "
                  f"{campaign_id})")
        except KeyboardInterrupt:
            live.stop()
            fail(f"interrupted; resume with: asyncrl campaign resume {campaign_id}", 130)
        except RuntimeError as e:
            if "Prefect API" not in str(e):
                raise
            live.stop()
            fail(f"Prefect's temporary API server did not start ({str(e).splitlines()[0]}); "
                  "the machine may be busy: try again, raise "
                  "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or run `asyncrl up` and "
                  "set PREFECT_API_URL")
        finally:
            cflow.EVENT_LISTENERS.remove(on_event)
    _print_outcome(console, out, as_json)
    if out["status"] != "finished":
        raise typer.Exit(2)


def _print_outcome(console, out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    from flows.tracking import Tracker, default_tracking_uri, redact_uri, where_to_look
    from registry.db import default_url

    console.print(f"campaign [bold]{out['campaign_id']}[/]: {out['status']} — {out['verdict']}")
    for stage, p in out.get("promoted", {}).items():
        console.print(f"  {stage}: promoted {p['candidate']} (recipe {p['recipe_hash']}, MLflow "
                      f"version {p.get('mlflow_version')}) → {p['checkpoint']}")
    diag = out.get("diagnosis")
    if diag:
        for f in diag.get("findings", []):
            console.print(f"  cause {f.get('cause')}: {f.get('title')} — {f.get('evidence')}; "
                          f"fix: {f.get('fix')}")
    uri = default_tracking_uri()
    link = Tracker(uri).run_url(out["mlflow_run_id"]) if out.get("mlflow_run_id") else None
    console.print(f"where to look: `asyncrl campaign status {out['campaign_id']}`; "
                  f"{where_to_look(uri)}" + (f" (this campaign: {link})" if link else "")
                  + f"; registry: {redact_uri(default_url())}", soft_wrap=True)


@campaign_app.command("launch")
def launch(
    path: Path = typer.Argument(..., metavar="CAMPAIGN.yaml", help="Campaign file."),
    campaign_id: str | None = typer.Option(None, "--id", help="Campaign id (default: "
                                           "<name>-<time>-<random>)."),
    as_json: bool = typer.Option(False, "--json", help="Print the outcome as JSON."),
    deployment: bool = typer.Option(
        False, "--deployment", help="Run it on the Prefect server at PREFECT_API_URL, through "
        "the deployment `asyncrl deploy CAMPAIGN.yaml` serves, instead of in this process; "
        "the run shows in the Prefect UI."),
    deployment_name: str | None = typer.Option(
        None, "--deployment-name", help="With --deployment: the deployment's name (default: the "
        "campaign's name, as `asyncrl deploy` names it)."),
    detach: bool = typer.Option(False, "--detach", help="With --deployment: submit and return; "
                                "follow with `asyncrl campaign status ID`."),
    timeout: float = typer.Option(0.0, "--timeout", help="With --deployment: stop waiting after "
                                  "this many seconds (0: wait until the run ends); the run goes "
                                  "on."),
) -> None:
    """Validate the campaign, record it in the registry and run its flow (Prefect, in-process by
    default; on a Prefect server with --deployment).
    Exit code 0: every stage promoted; 2: a stage had no passing candidate (see the verdict)."""
    from registry.campaign import CampaignError, load_campaign

    try:
        campaign, _ = load_campaign(path)
    except CampaignError as e:
        fail(str(e))
    require_state_dir()
    from flows.campaign import new_campaign_id

    cid = campaign_id or new_campaign_id(campaign.name)
    if deployment:
        _run_deployment(path, cid, deployment_name or campaign.name, as_json, detach, timeout)
    elif deployment_name or detach or timeout:
        fail("--deployment-name, --detach and --timeout go with --deployment")
    else:
        _run_flow(path, cid, as_json)


_TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _run_deployment(path: Path, campaign_id: str, name: str, as_json: bool, detach: bool,
                    timeout: float) -> None:
    """Create a flow run of the served deployment ``asyncrl-scheduled-campaign/<name>`` for this
    campaign file and id; unless ``detach``, follow it (stages from the registry) to its end."""
    import time

    from rich.console import Console


    api = os.environ.get("PREFECT_API_URL", "").strip()
    hint = (f"start one with `asyncrl up`, set PREFECT_API_URL=http://{HOST}:"
            f"{DEFAULT_PREFECT_PORT}/api and serve the campaign with `asyncrl deploy {path}`")
    if not api:
        fail(f"--deployment needs a Prefect server and PREFECT_API_URL is not set; {hint}")
    if not answers(api.rstrip("/") + "/health"):
        fail(f"no Prefect server answers at PREFECT_API_URL={api}; {hint}")
    from flows.deploy import FLOW_NAME  # importing flows configures Prefect before Prefect

    full = f"{FLOW_NAME}/{name}"
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(full)
        except Exception:  # prefect's ObjectNotFound (or an HTTP error saying the same)
            fail(f"no deployment {full!r} on {api}; serve it with `asyncrl deploy {path}"
                  + (f" --name {name}`" if name else "`")
                  + " (or pass --deployment-name)")
    run = run_deployment(full, parameters={"campaign_path": str(Path(path).resolve()),
                                           "campaign_id": campaign_id}, timeout=0)
    ui = api.rstrip("/").removesuffix("/api") + f"/runs/flow-run/{run.id}"
    console = Console(stderr=as_json)
    console.print(f"submitted campaign [bold]{campaign_id}[/] to deployment '{full}': "
                  f"flow run {run.name} ({ui})")
    if detach:
        console.print(f"follow it with `asyncrl campaign status {campaign_id}`")
        if as_json:
            typer.echo(json.dumps({"campaign_id": campaign_id, "flow_run_id": str(run.id),
                                   "flow_run_url": ui}, indent=2))
        return
    seen: dict[str, str] = {}
    start = time.monotonic()
    state = None
    with get_client(sync_client=True) as client:
        while True:
            state = client.read_flow_run(run.id).state
            db = _db()
            try:
                for st in db.stages(campaign_id):
                    if seen.get(st.name) != st.status:
                        seen[st.name] = st.status
                        console.print(f"  stage {st.name}: {st.status}")
            finally:
                db.close()
            if state is not None and state.type.value in _TERMINAL:
                break
            if timeout and time.monotonic() - start > timeout:
                fail(f"stopped waiting after {timeout:.0f} s; the run goes on: "
                      f"`asyncrl campaign status {campaign_id}`, {ui}", 3)
            time.sleep(2.0)
    db = _db()
    row = db.get_campaign(campaign_id)
    promos = db.promotions(campaign_id=campaign_id)
    db.close()
    if row is None:
        fail(f"the flow run ended ({state.type.value}: {state.message or ''}) before the "
              f"campaign was recorded; see {ui}")
    out = {"campaign_id": campaign_id, "status": row.status, "verdict": row.verdict or "",
           "diagnosis": row.diagnosis, "flow_run_id": str(run.id), "flow_run_url": ui,
           "promoted": {p.stage: {"candidate": p.candidate, "recipe_hash": p.recipe_hash,
                                  "checkpoint": p.checkpoint, "mlflow_version": p.mlflow_version}
                        for p in promos if p.actor == "auto"}}
    if state.type.value != "COMPLETED" and row.status not in ("finished", "stopped"):
        fail(f"flow run {state.type.value.lower()}: {state.message or ''} (campaign "
              f"{campaign_id}; see {ui}; resume with: asyncrl campaign resume {campaign_id})")
    _print_outcome(console, out, as_json)
    if out["status"] != "finished":
        raise typer.Exit(2)


@campaign_app.command("resume")
def resume(campaign_id: str = typer.Argument(..., help="Campaign id."),
           as_json: bool = typer.Option(False, "--json", help="Print the outcome as JSON.")
           ) -> None:
    """Continue a campaign: finished candidates and promotions are kept, an interrupted
    candidate resumes from its last checkpoint."""
    db = _read_db()
    row = db.get_campaign(campaign_id)
    db.close()
    if row is None:
        fail(f"no campaign {campaign_id!r} in the registry; `asyncrl campaign list` shows them")
    path = Path(row.spec.get("path", ""))
    if not path.is_file():
        fail(f"the campaign file {path} of {campaign_id} is gone; restore it to resume")
    _run_flow(path, campaign_id, as_json)


@campaign_app.command("list")
def list_campaigns(as_json: bool = typer.Option(False, "--json")) -> None:
    """Campaigns in the registry, newest first. A campaign recorded as running whose owner
    process is gone shows as crashed."""
    from registry.ownership import effective_status

    db = _read_db()
    rows: list[dict[str, Any]] = []
    try:
        for c in db.list_campaigns():
            status_now, owner = effective_status(db, c)
            rows.append({"id": c.id, "name": c.name, "status": status_now,
                         "verdict": _crashed_text(c.id, owner) if status_now == "crashed"
                         else c.verdict, "created_at": c.created_at,
                         "owner": None if owner is None else owner.to_dict()})
    finally:
        db.close()
    rows.sort(key=lambda r: r["created_at"], reverse=True)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table()
    for c in ("id", "name", "status", "created", "verdict"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["id"], r["name"], r["status"], r["created_at"][:19],
                  (r["verdict"] or "")[:80])
    Console().print(t)


@campaign_app.command("status")
def status(campaign_id: str | None = typer.Argument(None, help="Campaign id (default: the "
                                                     "newest)."),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Stages, candidates, gate results and promotions of a campaign."""
    db = _read_db()
    if campaign_id is None:
        campaigns = sorted(db.list_campaigns(), key=lambda c: c.created_at)
        if not campaigns:
            fail("no campaigns yet; start one with `asyncrl campaign launch campaigns/quick.yaml`")
        campaign_id = campaigns[-1].id
    row = db.get_campaign(campaign_id)
    if row is None:
        fail(f"no campaign {campaign_id!r}; `asyncrl campaign list` shows them")
    from registry.ownership import effective_status

    status_now, owner = effective_status(db, row)
    stages = db.stages(campaign_id)
    promotions = db.promotions(campaign_id=campaign_id)
    runs = [(r, db.gate_results(r.id)) for r in db.runs(campaign_id)]
    db.close()
    verdict = _crashed_text(campaign_id, owner) if status_now == "crashed" else row.verdict
    data = {"id": row.id, "name": row.name, "status": status_now,
            "recorded_status": row.status, "owner": None if owner is None else owner.to_dict(),
            "verdict": verdict, "diagnosis": row.diagnosis,
            "stages": [st.to_dict() for st in stages],
            "runs": [{"id": r.id, "stage": r.stage, "candidate": r.candidate,
                      "recipe_hash": r.recipe_hash, "status": r.status, "run_dir": r.run_dir,
                      "mlflow_run_id": r.mlflow_run_id, "gates": [g.to_dict() for g in gates],
                      "summary": r.summary or {}} for r, gates in runs],
            "promotions": [p.to_dict() for p in promotions]}
    if as_json:
        typer.echo(json.dumps(data, indent=2, default=str))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    con.print(f"campaign [bold]{escape(row.id)}[/] ({escape(row.name)}): {status_now}"
              + (f" — {escape(verdict)}" if verdict else ""))
    if status_now == "running" and owner is not None:
        con.print(f"owner: asyncrl {escape(owner.describe)}, last heartbeat "
                  f"{owner.heartbeat_at}")
    t = Table()
    for c in ("stage", "candidate", "status", "reward", "eval", "gates"):
        t.add_column(c)
    for r, gates in runs:
        s = r.summary or {}
        marks = " ".join(("✓" if g.passed else "✗") + g.name for g in gates)
        t.add_row(r.stage, r.candidate, r.status,
                  _num(s.get("rollout/reward_mean")), _num(s.get("eval/reward_mean")), marks)
    con.print(t)
    for p in promotions:
        con.print(f"promoted {p.stage}: {p.candidate} (recipe {p.recipe_hash}, "
                  f"{p.status}, by {p.actor}: {p.reason})")


@campaign_app.command("report")
def report(campaign_id: str | None = typer.Argument(None, help="Campaign id (default: the "
                                                     "newest)."),
           markdown: bool = typer.Option(True, "--markdown/--no-evidence", help=(
               "Markdown with every gate's evidence (default), or the tables alone.")),
           out: Path | None = typer.Option(None, "--out", help="Write to FILE.")) -> None:
    """A campaign's report in Markdown, generated from its records: per stage, each candidate's
    figures (q1 → q4 of the train–rollout and engine |Δlogp| and the reward, eval first → last
    with its n, max staleness), every gate's value vs its limit and verdict, the promotion and
    its reason, then each gate's evidence."""
    from registry.report import campaign_report
    from training.runtime.sinks import read_metrics

    def load(run_dir: str | None) -> list[dict[str, Any]]:
        path = Path(run_dir or "") / "metrics.jsonl"
        return read_metrics(path) if run_dir and path.is_file() else []

    db = _read_db()
    if campaign_id is None:
        campaigns = sorted(db.list_campaigns(), key=lambda c: c.created_at)
        if not campaigns:
            fail("no campaigns yet; start one with `asyncrl campaign launch campaigns/quick.yaml`")
        campaign_id = campaigns[-1].id
    try:
        text = campaign_report(db, campaign_id, load, evidence=markdown)
    except ValueError as e:
        fail(str(e))
    finally:
        db.close()
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}")


def _num(v: Any) -> str:
    return "—" if v is None else f"{float(v):.3g}"


def _crashed_text(campaign_id: str, owner: OwnerRecord | None) -> str:
    who = f"owner {owner.describe} is gone" if owner else "no owner process recorded"
    return f"crashed ({who}); resume with: asyncrl campaign resume {campaign_id}"


# --- registry -----------------------------------------------------------------------------------


@registry_app.command("list")
def registry_list(campaign_id: str | None = typer.Option(None, "--campaign"),
                  all_: bool = typer.Option(False, "--all", help="Include retired ones."),
                  as_json: bool = typer.Option(False, "--json")) -> None:
    """Promoted recipes (active ones unless --all)."""
    db = _read_db()
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
def registry_show(recipe_hash: str = typer.Argument(..., help="Recipe hash.")) -> None:
    """Print a registered recipe (YAML) and its promotions."""
    db = _read_db()
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
    recipe_hash: str = typer.Argument(..., help="Recipe hash (it must be registered)."),
    reason: str = typer.Option(..., "--reason", help="Why (recorded)."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help="HF checkpoint dir."),
    campaign_id: str | None = typer.Option(None, "--campaign"),
    stage: str | None = typer.Option(None, "--stage"),
    candidate: str = typer.Option("manual", "--candidate"),
    actor: str | None = typer.Option(None, "--by", help="Who (default: $USER)."),
) -> None:
    """Promote a recipe by hand (a person's decision, recorded with who and why)."""
    from registry.db import RegistryError

    db = _db()
    if db.get_recipe(recipe_hash) is None:
        fail(f"no recipe {recipe_hash!r} in the registry")
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

    db = _db()
    try:
        db.retire(promotion_id, actor=actor or os.environ.get("USER", "user"), reason=reason)
    except RegistryError as e:
        fail(str(e))
    db.close()
    typer.echo(f"promotion {promotion_id} retired")


# --- gates / diagnose / schema ------------------------------------------------------------------


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
    from that run (lag: the run's recipe's staleness bound, 1 without a recipe)."""
    from registry.gates import diagnosis_for, summarize

    history = _history(run)
    recipe, why = _run_recipe(run)
    ref = summarize(_history(reference)) if reference is not None else None
    bound = recipe.async_.staleness_bound if recipe is not None else None
    lag = 1 if bound is None else bound
    diag = diagnosis_for(history, recipe, reference=ref, lag=lag)
    if as_json:
        out = {**diag.to_dict(), "recipe": "recipe.yaml" if recipe is not None else None}
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    typer.echo(diag.summary)
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


def schema_campaign(out: Path | None = typer.Option(None, "--out", help="Write to FILE.")) -> None:
    """JSON schema of the campaign YAML."""
    from registry.campaign import campaign_json_schema

    text = json.dumps(campaign_json_schema(), indent=2)
    if out is None:
        typer.echo(text)
    else:
        out.write_text(text + "\n")
        typer.echo(f"wrote {out}")


def register(app: typer.Typer, schema_app: typer.Typer) -> None:
    """Attach these commands to the main CLI."""
    app.add_typer(campaign_app, name="campaign")
    app.add_typer(registry_app, name="registry")
    app.command("gates")(gates_cmd)
    app.command("diagnose")(diagnose_cmd)
    schema_app.command("campaign")(schema_campaign)
