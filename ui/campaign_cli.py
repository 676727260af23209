"""`asyncrl campaign …` and `asyncrl schema campaign`: launch, resume and follow staged campaigns
(Prefect flows), and read what they recorded (lazy imports, one-line errors)."""

from __future__ import annotations

import contextlib
import dataclasses
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
    open_registry,
    read_registry,
    require_state_dir,
    up_prefect_api,
)

if TYPE_CHECKING:
    from flows.launch import Launch
    from flows.results import CampaignOutcome
    from registry.campaign import Campaign
    from registry.db import OwnerRecord
    from training.recipe import Recipe

campaign_app = typer.Typer(help="Run staged campaigns (Prefect flows) and inspect them.",
                           no_args_is_help=True)


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

        failed = ", ".join(g.name for g in row.get("gates", []) if not g.passed)
        t.add_row(stage, cand, row.get("status", ""), f("rollout/reward_mean"),
                  f("eval/reward_mean"), f("mismatch/train_rollout/logprob_abs_diff/mean"),
                  f("async/staleness/mean"), failed)
    return t


class _EventLines:
    """What the live table shows, off a terminal (a file, a pipe, CI, nohup): one plain line per
    event, names whole, written at once — a stage starting, a candidate starting, its progress
    every ``every`` steps (default: a tenth of its steps) and at its last, its verdict with the
    failed gates' values and limits, a promotion; the warm start's progress by tenths."""

    def __init__(self, out: Any, every: int | None = None) -> None:
        self.out = out
        self.every = every
        self._warm: tuple[str, int] | None = None

    def line(self, text: str) -> None:
        import time

        self.out.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        self.out.flush()

    def __call__(self, ev: Any) -> None:
        from flows.events import (
            CandidateEvent,
            PredictionEvent,
            PromotedEvent,
            RemediationEvent,
            StageEvent,
            StepEvent,
        )

        if isinstance(ev, RemediationEvent | PredictionEvent):
            self.line(ev.line)
        elif isinstance(ev, StageEvent):
            self.line(f"stage {ev.stage}: {ev.shown}" + (f" — {ev.verdict}" if ev.verdict
                                                         else ""))
        elif isinstance(ev, StepEvent):
            every = self.every or max(1, ev.total // 10)
            if ev.step % every == 0 or ev.step == ev.total:
                reward = "" if ev.reward is None else f", rollout reward {ev.reward:.3g}"
                self.line(f"{ev.stage}/{ev.candidate}: step {ev.step}/{ev.total}{reward}")
        elif isinstance(ev, CandidateEvent):
            if ev.status == "running":
                self.line(f"{ev.stage}/{ev.candidate}: running (recipe {ev.recipe_hash})")
                return
            s = ev.summary or {}
            figures = "; ".join(f"{label} {s[key]:.3g}" for key, label in (
                ("rollout/reward_mean", "reward"), ("eval/reward_mean", "eval"))
                if isinstance(s.get(key), int | float))
            failed = [g for g in ev.gates or [] if not g.passed]
            gates = "; failed " + ", ".join(
                f"{g.name} (value {_num(g.value)}, limit {_num(g.threshold)})" for g in failed
            ) if failed else ""
            self.line(f"{ev.stage}/{ev.candidate}: {ev.status}"
                      + (f" ({figures})" if figures else "") + gates)
        elif isinstance(ev, PromotedEvent):
            self.line(f"stage {ev.stage}: promoted {ev.candidate}")

    def report(self, text: str | None) -> None:
        """The warm start's progress (``"train 120/700"``), a line per phase and tenth."""
        if text is None:
            if self._warm is not None:
                self.line("warm start: done")
            self._warm = None
            return
        phase, _, count = text.rpartition(" ")
        step, _, total = count.partition("/")
        if not (step.isdigit() and total.isdigit()):
            return self.line(f"warm start: {text}")
        tenth = int(step) * 10 // max(int(total), 1)
        if self._warm != (phase, tenth):
            self._warm = (phase, tenth)
            self.line(f"warm start: {text}")


def _flow_run_url(api: str, flow_run_id: Any) -> str:
    """The flow run's page in the Prefect UI: Prefect's own ``url_for`` (its UI URL setting,
    right for Prefect Cloud too), else the local server's layout under ``api``."""
    from prefect.utilities.urls import url_for

    try:
        url = url_for("flow-run", obj_id=str(flow_run_id))
    except Exception:  # an unexpected setting: the local layout below
        url = None
    return url or api.rstrip("/").removesuffix("/api") + f"/runs/flow-run/{flow_run_id}"


def _stop(live: Any) -> None:
    """Stop the live table (nothing to stop off a terminal)."""
    if live is not None:
        live.stop()


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _load(path: Path) -> tuple[Campaign, Recipe]:
    """The campaign in ``path`` and its base recipe, validated; a bad file is one line."""
    from registry.campaign import CampaignError, load_campaign

    try:
        return load_campaign(path)
    except CampaignError as e:
        fail(str(e))


def _run_flow(campaign: Campaign, base: Recipe, path: Path, campaign_id: str,
              as_json: bool) -> None:
    """Launch the loaded campaign — record it and take its ownership, so that a second
    launch/resume of it is refused in one line naming the owner, before Prefect starts — and
    run its flow in this process, which runs under this launch (:mod:`flows.launch`)."""
    require_state_dir()
    up_api = None
    if not os.environ.get("PREFECT_API_URL", "").strip():
        up_api = up_prefect_api()
        if up_api:  # before Prefect is imported: it reads its settings once
            os.environ["PREFECT_API_URL"] = up_api
    from flows import campaign as cflow  # configures Prefect before importing it
    from flows.launch import launch_campaign
    from registry.db import RegistryError

    try:
        with launch_campaign(campaign, base, path, campaign_id) as launched:
            _follow_flow(cflow, path, campaign_id, as_json, up_api,
                         _first_stage_recipes(launched), campaign_name=campaign.name)
    except RegistryError as e:  # CampaignOwnedError: another live process runs it
        fail(str(e))


def _first_stage_recipes(launched: Launch) -> list[Recipe]:
    """The recipes the campaign's first stage trains when this run will train it (no earlier
    run of the campaign promoted it): :func:`_start` builds their starting checkpoints, warm
    starts included, before the services start."""
    from registry.campaign import stage_recipes

    campaign = launched.campaign
    first = campaign.stages[0]
    if launched.db.promoted(launched.campaign_id, first.name) is not None:
        return []
    return [recipe for _, recipe in stage_recipes(campaign, first, launched.base, {}).candidates]


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
                 up_api: str | None = None, first: list[Recipe] | None = None, *,
                 campaign_name: str | None = None) -> None:
    from rich.console import Console
    from rich.live import Live

    from flows.events import (
        CampaignEvent,
        CandidateEvent,
        PredictionEvent,
        PromotedEvent,
        RemediationEvent,
        StepEvent,
    )
    from registry.campaign import CampaignError
    from registry.db import RegistryError
    from training.recipe import RecipeError
    from training.runtime.run import RunError

    console = Console(stderr=as_json)
    state: dict[tuple[str, str], dict[str, Any]] = {}
    # a terminal gets the live table; a file, a pipe or CI one plain line per event
    lines = None if console.is_interactive else _EventLines(console.file)

    with (Live(_live_table({}), console=console, refresh_per_second=4, transient=False)
          if lines is None else contextlib.nullcontext()) as live:
        def on_event(ev: CampaignEvent) -> None:
            if lines is not None:
                lines(ev)
                return
            if isinstance(ev, StepEvent):
                row = state.setdefault((ev.stage, ev.candidate), {})
                row["status"] = f"step {ev.step}/{ev.total}"
            elif isinstance(ev, CandidateEvent):
                row = state.setdefault((ev.stage, ev.candidate), {})
                row["status"] = ev.status
                row.update({k: v for k, v in (("summary", ev.summary), ("gates", ev.gates))
                            if v is not None})
            elif isinstance(ev, PromotedEvent):
                state.setdefault((ev.stage, ev.candidate), {})["status"] = "promoted"
            elif isinstance(ev, PredictionEvent):
                state.setdefault((ev.stage, ev.candidate), {})["status"] = (
                    f"predicted {ev.speedup:.2f}x")
            elif isinstance(ev, RemediationEvent):
                if ev.candidate is not None:
                    state.setdefault((ev.stage, ev.candidate), {})["status"] = (
                        f"remedy: cause {ev.cause}")
            elif ev.earlier:  # a StageEvent: promoted by an earlier run of this campaign
                state.setdefault((ev.stage, "(earlier)"), {})["status"] = ev.shown
            live.update(_live_table(state))

        cflow.EVENT_LISTENERS.append(on_event)
        try:
            if up_api:
                console.print(f"flow run on the Prefect server of `asyncrl up` ({up_api}); "
                              "keep it up until the campaign ends", soft_wrap=True)

            def report(text: str | None) -> None:
                if lines is not None:
                    lines.report(text)
                    return
                if text is None:
                    state.pop(("(warm start)", ""), None)
                else:
                    state[("(warm start)", "")] = {"status": text}
                live.update(_live_table(state))

            _start(first or [], report)
            # a stopped campaign ends its flow run Failed (flows.campaign.flow_result): read
            # the outcome from the state; an exception the flow raised is raised again here
            from prefect import tags  # the flow run's tags in the Prefect UI

            with tags("asyncrl", *([f"campaign:{campaign_name}"] if campaign_name else [])):
                flow_state = cflow.campaign_flow(str(path), campaign_id, return_state=True)
            outcome = flow_state.result(raise_on_failure=False)
            if isinstance(outcome, BaseException):
                raise outcome
        except (CampaignError, RecipeError, RunError, RegistryError) as e:
            _stop(live)
            fail(f"{e} (campaign {campaign_id}; resume with: asyncrl campaign resume "
                  f"{campaign_id})")
        except KeyboardInterrupt:
            _stop(live)
            fail(f"interrupted; resume with: asyncrl campaign resume {campaign_id}", 130)
        except RuntimeError as e:
            if "Prefect API" not in str(e):
                raise
            _stop(live)
            fail(f"Prefect's temporary API server did not start ({str(e).splitlines()[0]}); "
                  "the machine may be busy: try again, raise "
                  "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or run `asyncrl up` and "
                  "set PREFECT_API_URL")
        finally:
            cflow.EVENT_LISTENERS.remove(on_event)
    prefect_api = up_api or os.environ.get("PREFECT_API_URL", "").strip()
    flow_run_url = (_flow_run_url(prefect_api, flow_state.state_details.flow_run_id)
                    if prefect_api else None)  # none for Prefect's temporary server
    _print_outcome(console, outcome, outcome.to_json() if as_json else None,
                   flow_run_url=flow_run_url)
    if outcome.status != "finished":
        raise typer.Exit(2)


def _print_outcome(console, outcome: CampaignOutcome, as_json: dict[str, Any] | None, *,
                   flow_run_url: str | None = None) -> None:
    """The outcome in words, or ``as_json`` (its JSON form, when --json asked for it)."""
    if as_json is not None:
        typer.echo(json.dumps(as_json, indent=2, default=str))
        return
    from rich.markup import escape  # verdicts, evidence and paths may hold "[...]"

    from flows.tracking import Tracker, default_tracking_uri, redact_uri, where_to_look
    from registry.db import default_url
    from training.paths import state_path

    # soft_wrap: whole lines, never folded at 80 columns in a log file
    console.print(f"campaign [bold]{escape(outcome.campaign_id)}[/]: {outcome.status} — "
                  f"{escape(outcome.verdict)}", soft_wrap=True)
    for stage, p in outcome.promoted.items():
        console.print(f"  {stage}: promoted {p.candidate} (recipe {p.recipe_hash}, MLflow "
                      f"version {p.mlflow_version}) → {p.checkpoint}", soft_wrap=True,
                      markup=False)
    for n in outcome.gate_notes:
        where = f"  {n.stage}/{n.candidate}: {n.gate}"
        if n.passed:  # no value: too little data, so the pass says nothing
            console.print(f"{where} passed without a value — {n.evidence}", soft_wrap=True,
                          markup=False)
        else:
            margin = "" if n.margin is None else f", margin {n.margin:+.3g}"
            console.print(f"{where} failed: value {_num(n.value)}, limit {_num(n.threshold)}"
                          f"{margin} — {n.evidence}", soft_wrap=True, markup=False)
    if outcome.diagnosis:
        for f in outcome.diagnosis.get("findings", []):
            console.print(f"  cause {f.get('cause')}: {f.get('title')} — {f.get('evidence')}; "
                          f"fix: {f.get('fix')}", soft_wrap=True, markup=False)
    uri = default_tracking_uri()
    link = Tracker(uri).run_url(outcome.mlflow_run_id) if outcome.mlflow_run_id else None
    console.print(f"where to look: `asyncrl campaign status {outcome.campaign_id}`; "
                  f"{where_to_look(uri)}" + (f" (this campaign: {link})" if link else "")
                  + f"; registry: {redact_uri(default_url())}; state: {state_path()}",
                  soft_wrap=True, markup=False)
    if link:
        console.print(f"MLflow run: {link}", soft_wrap=True, markup=False)
    if flow_run_url:
        console.print(f"Prefect flow run: {flow_run_url}", soft_wrap=True, markup=False)


_RAY_ADDRESS = typer.Option(
    None, "--ray-address", help="Run the candidates on this Ray cluster (e.g. HOST:6379, or "
    "auto on a node of it) instead of a local Ray; same as $RAY_ADDRESS. Each run asks the "
    "cluster for its recipe's engines.placement resources.")


def _join_cluster(ray_address: str | None) -> None:
    """--ray-address: the campaign's runs join that cluster (the flow starts Ray from
    $RAY_ADDRESS, :func:`training.runtime.run.start_ray`)."""
    if ray_address:
        os.environ["RAY_ADDRESS"] = ray_address.strip()


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
    ray_address: str | None = _RAY_ADDRESS,
) -> None:
    """Validate the campaign, record it in the registry and run its flow (Prefect, in-process by
    default; on a Prefect server with --deployment).
    Exit code 0: every stage promoted; 2: a stage had no passing candidate (see the verdict)."""
    campaign, base = _load(path)
    require_state_dir()
    from flows.campaign import new_campaign_id

    cid = campaign_id or new_campaign_id(campaign.name)
    if deployment and ray_address:
        fail("--ray-address goes with an in-process launch; a deployment's runs join the "
             "cluster its work pool's RAY_ADDRESS names (platform/prefect.yaml)")
    _join_cluster(ray_address)
    if deployment:
        _run_deployment(path, cid, deployment_name or campaign.name, as_json, detach, timeout)
    elif deployment_name or detach or timeout:
        fail("--deployment-name, --detach and --timeout go with --deployment")
    else:
        _run_flow(campaign, base, path, cid, as_json)


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
    from flows.results import CampaignOutcome, Promoted

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
    ui = _flow_run_url(api, run.id)
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
            db = open_registry()
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
    from flows.results import recorded_gate_notes

    db = open_registry()
    row = db.get_campaign(campaign_id)
    promos = db.promotions(campaign_id=campaign_id)
    notes = recorded_gate_notes(db, campaign_id)
    db.close()
    if row is None:
        fail(f"the flow run ended ({state.type.value}: {state.message or ''}) before the "
              f"campaign was recorded; see {ui}")
    outcome = CampaignOutcome(
        campaign_id, row.status, row.verdict or "", diagnosis=row.diagnosis,
        promoted={p.stage: Promoted(p.candidate, p.recipe_hash, p.checkpoint, p.id,
                                    p.mlflow_version)
                  for p in promos if p.actor == "auto"}, gate_notes=notes)
    if state.type.value != "COMPLETED" and row.status not in ("finished", "stopped"):
        fail(f"flow run {state.type.value.lower()}: {state.message or ''} (campaign "
              f"{campaign_id}; see {ui}; resume with: asyncrl campaign resume {campaign_id})")
    _print_outcome(console, outcome,
                   _deployment_json(outcome, str(run.id), ui) if as_json else None,
                   flow_run_url=ui)
    if outcome.status != "finished":
        raise typer.Exit(2)


def _deployment_json(outcome: CampaignOutcome, flow_run_id: str,
                     flow_run_url: str) -> dict[str, Any]:
    """``launch --deployment --json``'s layout: the outcome as the registry recorded it (no
    MLflow run, no promotion ids) with the flow run's id and URL."""
    return {"campaign_id": outcome.campaign_id, "status": outcome.status,
            "verdict": outcome.verdict, "diagnosis": outcome.diagnosis,
            "flow_run_id": flow_run_id, "flow_run_url": flow_run_url,
            "gate_notes": [dataclasses.asdict(n) for n in outcome.gate_notes],
            "promoted": {stage: {"candidate": p.candidate, "recipe_hash": p.recipe_hash,
                                 "checkpoint": p.checkpoint, "mlflow_version": p.mlflow_version}
                         for stage, p in outcome.promoted.items()}}


@campaign_app.command("resume")
def resume(campaign_id: str = typer.Argument(..., help="Campaign id."),
           as_json: bool = typer.Option(False, "--json", help="Print the outcome as JSON."),
           ray_address: str | None = _RAY_ADDRESS) -> None:
    """Continue a campaign: finished candidates and promotions are kept, an interrupted
    candidate resumes from its last checkpoint."""
    _join_cluster(ray_address)
    db = read_registry()
    row = db.get_campaign(campaign_id)
    db.close()
    if row is None:
        fail(f"no campaign {campaign_id!r} in the registry; `asyncrl campaign list` shows them")
    path = Path(row.spec.get("path", ""))
    if not path.is_file():
        fail(f"the campaign file {path} of {campaign_id} is gone; restore it to resume")
    campaign, base = _load(path)
    _run_flow(campaign, base, path, campaign_id, as_json)


@campaign_app.command("list")
def list_campaigns(as_json: bool = typer.Option(False, "--json")) -> None:
    """Campaigns in the registry, newest first. A campaign recorded as running whose owner
    process is gone shows as crashed."""
    from registry.ownership import effective_status

    db = read_registry()
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
    db = read_registry()
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
    remediations = db.remediations(campaign_id)
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
            "promotions": [p.to_dict() for p in promotions],
            "remediations": [a.to_dict() for a in remediations]}
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
    for a in remediations:
        if a.candidate is None:
            con.print(f"remediation {a.stage} #{a.attempt}: no remedy left for "
                      f"{escape(a.from_candidate)}")
            continue
        import shlex

        sets = " ".join("--set " + shlex.quote(f"{k}={json.dumps(v)}")
                        for k, v in (a.override or {}).items())
        con.print(f"remediation {a.stage} #{a.attempt}: {escape(a.candidate)} from "
                  f"{escape(a.from_candidate)}, cause {escape(str(a.cause))} "
                  f"({escape(str(a.title))}): {a.status}; override: {escape(sets)}")
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

    db = read_registry()
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
    """Attach ``asyncrl campaign`` and ``asyncrl schema campaign`` to the main CLI."""
    app.add_typer(campaign_app, name="campaign")
    schema_app.command("campaign")(schema_campaign)
