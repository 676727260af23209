"""The asyncrl dashboard: a FastAPI app rendering server-side HTML from the registry, the run
directories and (for links) the MLflow and Prefect servers. It only reads.

Pages: ``/`` the campaigns; ``/campaign/ID`` the ladder (stages × candidates, each cell with its
gates — value, limit, margin and evidence — its key numbers, its promotion and links), which
refreshes itself while the campaign runs by polling ``/campaign/ID/ladder`` (an HTML fragment)
every :data:`POLL_S` seconds; ``/campaign/ID/run/RUN`` a candidate's diagnostics (Plotly charts
overlaid with its stage's other runs and the reference), its diagnosis, its recipe diff and its
sampled rollouts; ``/registry`` promotions, lineage and retirements; ``/run/RUN/files/PATH`` a
file of a run directory (read-only, inside it only). ``/health`` answers ``{"status": "ok"}``.
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse, HTMLResponse, Response

from ui.dashboard import data as D
from ui.dashboard.charts import Curve, run_charts

POLL_S = 2.0
LINK_TIMEOUT_S = 1.5
RETRY_LINK_S = 30.0


@dataclass(frozen=True)
class DashboardConfig:
    """Where the dashboard reads: the registry URL (None: ``$ASYNCRL_HOME``'s default), and the
    MLflow and Prefect UIs to link to (None: found from ``asyncrl up``'s record or the
    environment when a page is drawn; no links without them)."""

    registry_url: str | None = None
    mlflow_url: str | None = None
    prefect_api: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    """Host headers the server answers (a page elsewhere cannot read it through DNS
    rebinding); None: any (tests)."""


def allowed_hosts_for(bind: str) -> tuple[str, ...] | None:
    """The Host headers to accept when serving on ``bind``: loopback names for a loopback
    address, any for an address open to the network (its name is not known here)."""
    if bind in ("0.0.0.0", "::", ""):
        return None
    return (bind, "localhost", "127.0.0.1", "::1")


def _services() -> dict[str, Any]:
    from training.paths import state_dir

    path = state_dir() / "services.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class _Links:
    """MLflow run and Prefect flow-run URLs, looked up on their servers (cached per process)."""

    def __init__(self, cfg: DashboardConfig) -> None:
        self.cfg = cfg
        self._cache: dict[tuple[str, str], str | None] = {}
        self._failed: dict[tuple[str, str], float] = {}  # when a lookup last found nothing

    def _mlflow_base(self) -> str | None:
        if self.cfg.mlflow_url:
            return self.cfg.mlflow_url.rstrip("/")
        env = os.environ.get("MLFLOW_TRACKING_URI", "")
        if env.startswith(("http://", "https://")):
            return env.rstrip("/")
        entry = _services().get("mlflow")
        return entry.get("url") if isinstance(entry, dict) else None

    def _prefect_api(self) -> str | None:
        if self.cfg.prefect_api:
            return self.cfg.prefect_api.rstrip("/")
        env = os.environ.get("PREFECT_API_URL", "")
        if env:
            return env.rstrip("/")
        entry = _services().get("prefect")
        return entry["url"].rstrip("/") + "/api" if isinstance(entry, dict) and entry.get(
            "url") else None

    def _get(self, key: tuple[str, str], fetch: Any) -> str | None:
        """A looked-up URL, cached once found. A lookup that found nothing (a server down, a
        flow run not there yet) is tried again after :data:`RETRY_LINK_S`, so a live ladder
        polling a slow or absent server waits at most one timeout per run that often."""
        import time

        if self._cache.get(key) is not None:
            return self._cache[key]
        if time.monotonic() - self._failed.get(key, -math.inf) < RETRY_LINK_S:
            return None
        try:
            url = fetch()
        except Exception:  # a server down or a run it does not know: no link, no error
            url = None
        if url is None:
            self._failed[key] = time.monotonic()
        else:
            self._cache[key] = url
        return url

    def mlflow_run(self, run_id: str | None) -> str | None:
        base = self._mlflow_base()
        if not run_id or not base:
            return None

        def fetch() -> str | None:
            import httpx

            r = httpx.get(f"{base}/api/2.0/mlflow/runs/get", params={"run_id": run_id},
                          timeout=LINK_TIMEOUT_S)
            r.raise_for_status()
            exp = r.json()["run"]["info"]["experiment_id"]
            return f"{base}/#/experiments/{exp}/runs/{run_id}"

        return self._get(("mlflow", run_id), fetch)

    def prefect_flow_run(self, campaign_id: str) -> str | None:
        api = self._prefect_api()
        if not api:
            return None

        def fetch() -> str | None:
            import httpx

            # the newest: a resumed campaign has one flow run per launch, all named by its id
            r = httpx.post(f"{api}/flow_runs/filter", timeout=LINK_TIMEOUT_S,
                           json={"flow_runs": {"name": {"any_": [campaign_id]}},
                                 "sort": "EXPECTED_START_TIME_DESC", "limit": 1})
            r.raise_for_status()
            runs = r.json()
            if not runs:
                return None
            return api.removesuffix("/api") + f"/runs/flow-run/{runs[0]['id']}"

        return self._get(("prefect", campaign_id), fetch)


# --- formatting ---------------------------------------------------------------------------------


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.{digits}g}"
    return str(v)


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _script_json(value: Any) -> Any:
    """``value`` as JSON for a ``<script>`` block (``</`` escaped so no string ends it)."""
    from markupsafe import Markup

    return Markup(json.dumps(value, allow_nan=False).replace("</", "<\\/"))


def _env() -> Any:
    from jinja2 import Environment, PackageLoader, select_autoescape

    env = Environment(loader=PackageLoader("ui.dashboard", "templates"),
                      autoescape=select_autoescape(["html"]), trim_blocks=True,
                      lstrip_blocks=True)
    env.filters["fmt"] = fmt
    env.filters["duration"] = duration
    env.filters["tojson_safe"] = _script_json
    env.globals["POLL_MS"] = int(POLL_S * 1000)
    env.globals["token_heat"] = token_heat
    return env


# --- the app ------------------------------------------------------------------------------------


def create_app(cfg: DashboardConfig | None = None) -> FastAPI:
    """The dashboard app (see the module docstring for its pages)."""
    cfg = cfg or DashboardConfig()
    app = FastAPI(title="asyncrl dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    if cfg.allowed_hosts is not None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(cfg.allowed_hosts))
    env = _env()
    links = _Links(cfg)

    def page(template: str, **ctx: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(template).render(**ctx))

    def open_db() -> Any:
        from registry.records import RegistryError
        from registry.sqlite_reader import open_reader

        try:
            db = open_reader(cfg.registry_url)
        except RegistryError as e:
            raise HTTPException(503, f"the registry cannot be read: {e}") from None
        return db

    def load(campaign_id: str) -> D.CampaignView:
        db = open_db()
        if db is None:
            raise HTTPException(404, f"no campaign {campaign_id!r}: the registry is empty")
        try:
            view = D.campaign_view(db, campaign_id)
        finally:
            db.close()
        if view is None:
            raise HTTPException(404, f"no campaign {campaign_id!r}")
        return view

    def ladder_ctx(view: D.CampaignView) -> dict[str, Any]:
        mlflow = {r.id: links.mlflow_run(r.mlflow_run_id) for s in view.stages for r in s.runs}
        return {"c": view, "mlflow": mlflow, "prefect": links.prefect_flow_run(view.id)}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        from training.paths import state_path

        db = open_db()
        views: list[D.CampaignView] = []
        if db is not None:
            try:
                views = D.campaign_views(db)
            finally:
                db.close()
        return page("index.html", campaigns=views, home=str(state_path()))

    @app.get("/campaign/{campaign_id}", response_class=HTMLResponse)
    def campaign(campaign_id: str) -> HTMLResponse:
        return page("campaign.html", **ladder_ctx(load(campaign_id)))

    @app.get("/campaign/{campaign_id}/ladder", response_class=HTMLResponse)
    def ladder(campaign_id: str) -> HTMLResponse:
        return page("_ladder.html", **ladder_ctx(load(campaign_id)))

    @app.get("/campaign/{campaign_id}/run/{run_id}", response_class=HTMLResponse)
    def run(campaign_id: str, run_id: int, colour: str = "dlogp") -> HTMLResponse:
        view = load(campaign_id)
        focus = view.run(run_id)
        if focus is None:
            raise HTTPException(404, f"campaign {campaign_id!r} has no run {run_id}")
        stage = view.stage(focus.stage)
        assert stage is not None
        db = open_db()
        try:
            recipes = {r.recipe_hash: D.recipe_data(db, r.recipe_hash) for r in stage.runs}
            base_hash = D.stage_base_hash(view, stage)
            base = D.recipe_data(db, base_hash) if base_hash else None
        finally:
            db.close()
        reference = _reference(view, stage)
        curves = [_curve(focus, "focus", recipes)]
        curves += [_curve(r, "peer", recipes) for r in stage.runs
                   if r.id != focus.id and not r.is_reference]
        if reference is not None:
            curves.append(_curve(reference, "reference", recipes))
        charts = run_charts(curves)
        diagnosis = _diagnosis(focus, recipes.get(focus.recipe_hash))
        diff = D.recipe_diff(base, recipes.get(focus.recipe_hash), base_hash)
        rollouts = _rollouts(focus.run_dir)
        by_weight = colour == "weight"
        return page("run.html", c=view, r=focus, stage=stage, charts=charts,
                    diagnosis=diagnosis, diff=diff, base_hash=base_hash,
                    rollouts=rollouts, by_weight=by_weight,
                    colour_scale=_colour_scale(rollouts, by_weight), mlflow=links.mlflow_run(
                        focus.mlflow_run_id), prefect=links.prefect_flow_run(view.id),
                    reference=reference)

    @app.get("/registry", response_class=HTMLResponse)
    def registry() -> HTMLResponse:
        db = open_db()
        promotions: list[Any] = []
        origins: dict[str, str | None] = {}
        if db is not None:
            try:
                promotions = list(db.promotions())
                for p in promotions:
                    data = D.recipe_data(db, p.recipe_hash) or {}
                    origin = str((data.get("model") or {}).get("origin") or "")
                    origins[p.recipe_hash] = (origin.removeprefix("recipe:")
                                              if origin.startswith("recipe:") else None)
            finally:
                db.close()
        return page("registry.html", promotions=sorted(promotions, key=lambda p: p.created_at,
                                                        reverse=True), origins=origins)

    @app.get("/run/{campaign_id}/{run_id}/files/{path:path}")
    def run_file(campaign_id: str, run_id: int, path: str = "") -> Response:
        from urllib.parse import quote

        db = open_db()
        try:
            r = (next((x for x in db.runs(campaign_id) if x.id == run_id), None)
                 if db is not None else None)
        finally:
            if db is not None:
                db.close()
        if r is None or not r.run_dir:
            raise HTTPException(404, f"campaign {campaign_id!r} has no run {run_id} on disk")
        root = Path(r.run_dir).resolve()
        target = (root / path).resolve()
        if target != root and root not in target.parents:
            raise HTTPException(404, "outside the run directory")
        if target.is_dir():
            items = sorted(target.iterdir(), key=lambda p: (p.is_file(), p.name))
            rows = "".join(
                f"<li><a href='{html.escape(quote(p.name) + ('/' if p.is_dir() else ''))}'>"
                f"{html.escape(p.name)}{'/' if p.is_dir() else ''}</a></li>" for p in items)
            return HTMLResponse(f"<!doctype html><title>{html.escape(str(target))}</title>"
                                f"<h3>{html.escape(str(target))}</h3><ul>{rows}</ul>")
        if not target.is_file():
            raise HTTPException(404, f"no file {path!r} in the run directory")
        media = "text/plain; charset=utf-8" if target.suffix in (
            ".jsonl", ".yaml", ".json", ".txt", ".log") else None
        # a run's files are shown, never run: an HTML report renders sandboxed (no scripts, an
        # origin of its own), and nothing is sniffed into another type
        return FileResponse(target, media_type=media, headers={
            "X-Content-Type-Options": "nosniff", "Content-Security-Policy": "sandbox"})

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        if name == "plotly.min.js":
            return FileResponse(str(resources.files("plotly") / "package_data" / "plotly.min.js"),
                                media_type="application/javascript",
                                headers={"Cache-Control": "max-age=86400"})
        if name in ("dashboard.css", "dashboard.js"):
            res = resources.files("ui.dashboard") / "static" / name
            return Response(res.read_text(), media_type="text/css" if name.endswith(".css")
                            else "application/javascript")
        raise HTTPException(404, f"no static file {name!r}")

    @app.exception_handler(HTTPException)
    def http_error(_: Any, exc: HTTPException) -> Response:
        body = env.get_template("error.html").render(status=exc.status_code, detail=exc.detail)
        return HTMLResponse(body, status_code=exc.status_code)

    app.state.config = cfg
    return app


def _reference(view: D.CampaignView, stage: D.StageView) -> D.RunView | None:
    """The run a stage's candidates are compared with: a re-run reference inside the stage,
    else the previous stage's promoted run."""
    rerun = [r for r in stage.runs if r.is_reference]
    if rerun:
        return rerun[0]
    for s in reversed([s for s in view.stages if s.index < stage.index]):
        promoted = [r for r in s.runs if r.promoted]
        if promoted:
            return promoted[0]
    return None


def _curve(r: D.RunView, role: str, recipes: dict[str, Any]) -> Curve:
    label = r.candidate if role != "reference" else f"reference ({r.stage}/{r.candidate})"
    return Curve(label, D.RunSeries.of(D.read_history(r.run_dir),
                                       D.samples_per_step(recipes.get(r.recipe_hash))),
                 role, r.passed or not r.judged)


def _diagnosis(r: D.RunView, recipe: dict[str, Any] | None) -> Any:
    """Seed 001's decision tree on a run that failed its gates (None for one that passed), with
    what its ``gate_report.json`` says it was judged with, as the campaign's verdict and
    remediation diagnosed it."""
    if not r.judged or r.passed or not r.run_dir:
        return None
    history = D.read_history(r.run_dir)
    if not history:
        return None
    from registry.gates import diagnosis_as_judged
    from training.recipe import RecipeError, recipe_from_dict

    try:
        rec = recipe_from_dict(recipe, "stored recipe") if recipe else None
    except RecipeError:
        rec = None
    try:
        judged = json.loads((Path(r.run_dir) / "gate_report.json").read_text()).get(
            "judged_with") or {}
    except (OSError, ValueError):
        judged = {}
    return diagnosis_as_judged(history, rec, judged)


def _rollouts(run_dir: str | None) -> list[dict[str, Any]]:
    """The sampled trajectories a run kept (``rollouts.jsonl``), newest steps first."""
    if not run_dir:
        return []
    from training.runtime.traces import ROLLOUTS_FILE, read_traces

    rows = read_traces(Path(run_dir) / ROLLOUTS_FILE)
    return sorted(rows, key=lambda r: -int(r.get("step", 0)))[:MAX_ROLLOUT_ROWS]


MAX_ROLLOUT_ROWS = 24


def token_heat(token: dict[str, Any], by_weight: bool) -> float:
    """What a token is coloured by: its |Δlogp|, or its IS weight's distance from 1."""
    v = token.get("w") if by_weight else token.get("d")
    if not isinstance(v, int | float) or not math.isfinite(v):
        return 0.0
    return abs(v - 1.0) if by_weight else abs(v)


def _colour_scale(rows: list[dict[str, Any]], by_weight: bool) -> float:
    """The heat that is full red: the 99th percentile over the tokens shown (so the page's
    contrast follows the run's own scale), at least 1e-6."""
    heats = sorted(token_heat(k, by_weight) for r in rows for k in r["tokens"])
    if not heats:
        return 1.0
    return max(heats[min(len(heats) - 1, int(0.99 * len(heats)))], 1e-6)
