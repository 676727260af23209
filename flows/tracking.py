"""MLflow tracking glue: one parent run per campaign, one child run per candidate, metrics streamed
in batches, checkpoints registered as model versions with an alias per stage.

Where the data lives (DESIGN.md "Services"): by default a SQLite store at
``$ASYNCRL_HOME/mlflow/mlflow.db`` and artifacts under ``$ASYNCRL_HOME/mlflow/artifacts``;
``MLFLOW_TRACKING_URI`` points everything at a team server instead (its own artifact store is used
then), or at a database store directly, e.g. PostgreSQL (``postgresql://user:pass@host/db``,
read as ``postgresql+psycopg://``: psycopg 3, see ``registry.db.with_psycopg3``), whose
artifacts stay under ``$ASYNCRL_HOME/mlflow/artifacts``. MLflow's file store is in maintenance
mode in 3.x and refuses new use, so the local default is SQLite.

Tracking never kills a run (STYLE.md 10): every :class:`Tracker` method logs a warning on the
``asyncrl.tracking`` logger and returns ``None`` when MLflow fails, and :class:`MLflowSink` retries
a failed flush a few times, then turns itself off. ``metrics.jsonl`` of the run stays the source of
truth; :meth:`MLflowSink.log_history` fills MLflow in from it later.

Metric points are never logged one call each (FACTS.md "MLflow 3.17.2": a ``log_metric`` loop is
~70x slower than ``log_batch``): the sink buffers and sends one ``log_batch`` per <= 999 points.

Resume without duplicates. MLflow only appends metric points, so the run carries a watermark tag,
``asyncrl.logged_until_step`` = N, meaning "every point of every step <= N is in MLflow". The sink
only ever sends whole steps (a step is complete when a later step arrives, or at ``close``; only a
single step of more than 999 metrics is split), and the watermark travels in the same
``log_batch`` request as the points that complete it, so it is never ahead of the data (MLflow
commits the request's points and tags separately, so a kill between them can leave the tag behind:
every sent step ends with a :data:`STEP_MARK` point, whose history a new sink reads too); after a
failed request the unsent points stay buffered in order, so it is never behind what was sent
either. A new sink on the same run (a resumed campaign) reads the watermark and skips every step
<= N, both from the live trainer and in :meth:`MLflowSink.log_history`. Consequence: steps a
resumed trainer redoes after its checkpoint keep, in MLflow, the points of the first attempt when
they were already sent; ``metrics.jsonl`` holds the redone values, and gates read that file.
Replays also use the JSONL's own timestamps, which a SQL-backed store deduplicates as a second
line of defence.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from training.paths import state_dir
from training.runtime.sinks import NullSink

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

__all__ = [
    "TAG_CAMPAIGN",
    "TAG_CANDIDATE",
    "TAG_KIND",
    "TAG_LOGGED_UNTIL",
    "TAG_MODE",
    "TAG_RECIPE_HASH",
    "TAG_STAGE",
    "MLflowSink",
    "TrackedRun",
    "Tracker",
    "default_artifact_root",
    "default_tracking_uri",
    "flatten_params",
    "metric_key",
    "redact_uri",
]

log = logging.getLogger("asyncrl.tracking")

TAG_KIND = "asyncrl.kind"  # "campaign" (parent run) or "candidate" (child run)
TAG_CAMPAIGN = "asyncrl.campaign_id"
TAG_STAGE = "asyncrl.stage"
TAG_CANDIDATE = "asyncrl.candidate"
TAG_RECIPE_HASH = "asyncrl.recipe_hash"
TAG_MODE = "asyncrl.mode"
TAG_LOGGED_UNTIL = "asyncrl.logged_until_step"
STEP_MARK = "asyncrl/step"
"""A metric the sink logs as the last point of every step it sends (value = the step): MLflow
stores a ``log_batch``'s points and its tags in separate transactions, so a ``kill -9`` between the
two leaves points stored with the watermark tag behind; the highest step of this metric's history
then says what is stored (a step's points go in one request, and the mark is its last point)."""
TAG_PROMOTED = "asyncrl.promoted"  # "true" on a candidate run its stage promoted
TAG_CHAMPION = "asyncrl.champion"  # on the parent run: "<stage>/<candidate>" promoted last
TAG_DESCRIPTION = "mlflow.note.content"  # what MLflow's UI shows as a run's description
# MLflow 3 opens an experiment without this tag in its GenAI view ("Evaluation runs", the
# parent showing "Metrics (0)"); this value is its model-training view
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
_PARENT_TAG = "mlflow.parentRunId"

#: MLflow accepts at most 1000 entities (metrics + params + tags) in one ``log_batch``; one slot
#: is kept for the watermark tag.
BATCH_POINTS = 999
PARAMS_PER_BATCH = 100  # MLflow's per-request limit for params and for tags
PARAM_VALUE_MAX = 500
_TAG_VALUE_MAX = 8000
_KEY_MAX = 250
_RESERVED_ROW_KEYS = frozenset({"step", "time", "_nonfinite"})
CHECKPOINT_ARTIFACT = "checkpoint"
_SLOW_FAILURE_S = 60.0
UI_URL_ENV = "ASYNCRL_MLFLOW_UI_URL"
DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where `mlflow ui` / `asyncrl up` serve a local store


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///$ASYNCRL_HOME/mlflow/mlflow.db``."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    path = state_dir() / "mlflow" / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def default_artifact_root() -> str:
    """``file://$ASYNCRL_HOME/mlflow/artifacts`` (created)."""
    path = state_dir() / "mlflow" / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


def ui_base_url(tracking_uri: str) -> str:
    """Where a browser reaches the MLflow UI of ``tracking_uri``: the tracking server itself for
    an http(s) URI, else the local UI that `mlflow ui` / `asyncrl up` serve for a store
    ($ASYNCRL_MLFLOW_UI_URL, default http://127.0.0.1:5000)."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return os.environ.get(UI_URL_ENV, DEFAULT_UI_URL).rstrip("/")


def where_to_look(tracking_uri: str) -> str:
    """How to open the MLflow UI: the server's address, or the command that serves a local
    store (a server URL is not a store: ``mlflow ui --backend-store-uri http://…`` fails)."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"MLflow UI at {redact_uri(tracking_uri)}"
    return (f"MLflow: `mlflow ui --backend-store-uri {redact_uri(tracking_uri)}` (or `asyncrl "
            f"up`), then {ui_base_url(tracking_uri)}")


_PASSWORD = re.compile(r"(://[^:/@]*:)[^@/]*@")


def redact_uri(uri: str) -> str:
    """``uri`` with the password of its ``user:password@`` part shown as ``***``, for logs."""
    return _PASSWORD.sub(r"\1***@", uri, count=1)


_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def _is_local_store(uri: str) -> bool:
    """A store MLflow opens itself (a database or a path), not a tracking server: its artifacts
    need a root chosen here, else MLflow would use ``./mlruns`` of the working directory."""
    scheme = uri.split("://", 1)[0].split("+", 1)[0] if "://" in uri else ""
    return uri.startswith(("file:", "/", ".")) or "://" not in uri or scheme in _DB_SCHEMES


_BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")


def metric_key(key: str) -> str:
    """``key`` as a valid MLflow metric/param name: '/' kept (the metric namespace), any character
    MLflow rejects replaced by '_', empty and '.'/'..' path segments removed so the name is a
    normalised relative path, at most 250 characters."""
    clean = _BAD_KEY_CHARS.sub("_", str(key))
    parts = [("__" if p == ".." else p) for p in clean.split("/") if p not in ("", ".")]
    return ("/".join(parts) or "_")[:_KEY_MAX]


def _finite(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"),
                                                          default=str)
    return text[:PARAM_VALUE_MAX]


def flatten_params(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested recipe dict as MLflow params: dotted keys (``algorithm.loss.name``), list items
    of dicts by index (``...sources.0.kind``), other values as JSON text (``true``, ``null``,
    ``[1,2]``) or the string itself, cut to 500 characters; an empty dict stays as ``{}``."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_params(value, name + "."))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            for i, item in enumerate(value):
                out.update(flatten_params(item, f"{name}.{i}."))
        else:
            out[metric_key(name)] = _param_value(value)
    return out


def _recipe_dict(recipe: Any) -> dict[str, Any]:
    if hasattr(recipe, "to_dict"):
        return recipe.to_dict()
    if isinstance(recipe, Mapping):
        return dict(recipe)
    raise TypeError(f"recipe must be a Recipe or a mapping, got {type(recipe).__name__}")


_T = TypeVar("_T")


def _tolerant(what: str) -> Callable[[Callable[..., _T]], Callable[..., _T | None]]:
    """Turn any failure of a Tracker method into a warning and ``None`` (STYLE.md 10)."""

    def deco(fn: Callable[..., _T]) -> Callable[..., _T | None]:
        @functools.wraps(fn)
        def wrapper(self: Tracker, *args: Any, **kwargs: Any) -> _T | None:
            if self.client is None:
                log.warning("MLflow %s skipped: tracking is off (%s)", what, self.error)
                return None
            try:
                return fn(self, *args, **kwargs)
            except Exception as err:  # tolerated on purpose: tracking must not stop a campaign
                log.warning("MLflow %s failed (%s: %s); going on without it", what,
                            type(err).__name__, err)
                return None

        return wrapper

    return deco


def _probe(uri: str, timeout: float = 5.0) -> None:
    """Fail fast when a tracking server cannot be reached at all: MLflow's own HTTP retries
    would stall every call for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES, ..._BACKOFF_FACTOR,
    ..._TIMEOUT tune them). Any HTTP answer, even an error status, counts as reachable."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            pass
    except urllib.error.HTTPError:
        pass


def _filter_value_ok(value: str) -> bool:
    return "'" not in value and "\\" not in value


class Tracker:
    """A thin, failure-tolerant wrapper over :class:`mlflow.MlflowClient` for campaigns.

    Args:
        tracking_uri: default :func:`default_tracking_uri`. The model registry uses the same URI.
        artifact_root: where new experiments keep artifacts; default :func:`default_artifact_root`
            for a database store (SQLite, PostgreSQL) and the server's own choice for a tracking
            server.
    """

    def __init__(self, tracking_uri: str | None = None, artifact_root: str | None = None) -> None:
        self.client: MlflowClient | None = None
        self.error: str | None = None
        self.tracking_uri = tracking_uri or ""
        self.artifact_root = artifact_root
        try:
            self.tracking_uri = tracking_uri or default_tracking_uri()
            if artifact_root is None and _is_local_store(self.tracking_uri):
                self.artifact_root = default_artifact_root()
            if self.tracking_uri.startswith("sqlite:///"):
                db = Path(self.tracking_uri.removeprefix("sqlite:///"))
                if str(db) not in ("", ":memory:"):
                    db.parent.mkdir(parents=True, exist_ok=True)
            if self.tracking_uri.startswith(("http://", "https://")):
                _probe(self.tracking_uri)
            from mlflow import MlflowClient

            from registry.db import with_psycopg3

            store = with_psycopg3(self.tracking_uri)  # a bare postgresql:// means psycopg 3
            self.client = MlflowClient(tracking_uri=store, registry_uri=store)
        except Exception as err:  # a broken URI turns tracking off, never the campaign
            self.error = f"{type(err).__name__}: {err}"
            log.warning("MLflow tracking at %s is unavailable (%s); the campaign runs without "
                        "it", redact_uri(self.tracking_uri), self.error)

    # --- experiments and runs ---------------------------------------------------------------
    @_tolerant("experiment")
    def experiment(self, name: str) -> str:
        """The id of experiment ``name``, created (or restored, if deleted) when needed."""
        assert self.client is not None
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            if EXPERIMENT_KIND[0] not in exp.tags:  # made by an older asyncrl; a user's wins
                try:
                    self.client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
                except Exception as e:  # only how MLflow's UI opens it; tracking goes on
                    log.warning("MLflow experiment %s: kind tag not set (%s)", name, e)
            return exp.experiment_id
        location = None
        if self.artifact_root:
            slug = metric_key(name).replace("/", "_").replace(" ", "_")
            if slug != name:
                slug += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
            location = f"{self.artifact_root.rstrip('/')}/{slug}"
        try:
            return self.client.create_experiment(name, artifact_location=location,
                                                 tags=dict([EXPERIMENT_KIND]))
        except Exception:
            exp = self.client.get_experiment_by_name(name)  # created concurrently
            if exp is None:
                raise
            return exp.experiment_id

    def _find_run(self, experiment_id: str, tags: Mapping[str, str]) -> Any:
        """The oldest active run of the experiment carrying all ``tags``, or None."""
        assert self.client is not None
        clauses = [f"tags.`{k}` = '{v}'" for k, v in tags.items() if _filter_value_ok(v)]
        runs = self.client.search_runs([experiment_id], " and ".join(clauses),
                                       order_by=["attributes.start_time ASC"], max_results=1000)
        for run in runs:
            if all(run.data.tags.get(k) == v for k, v in tags.items()):
                return run
        return None

    def _continue(self, run: Any) -> str:
        assert self.client is not None
        if run.info.status != "RUNNING":
            self.client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id

    def campaign_run(self, experiment: str, campaign_id: str, name: str,
                     tags: Mapping[str, Any] | None = None) -> TrackedRun:
        """The campaign's parent run in experiment ``experiment`` (created when needed; the
        existing one continued, :meth:`start_campaign_run`) — a run that does nothing when
        tracking is off."""
        exp = self.experiment(experiment)
        run = self.start_campaign_run(exp, campaign_id, name, tags=tags) if exp else None
        return TrackedRun(self, exp, run)

    @_tolerant("start_campaign_run")
    def start_campaign_run(self, experiment_id: str, campaign_id: str, name: str,
                           tags: Mapping[str, Any] | None = None) -> str:
        """The campaign's parent run: the existing one (status back to RUNNING) when a run
        tagged with this ``campaign_id`` exists, else a new one."""
        assert self.client is not None
        key = {TAG_KIND: "campaign", TAG_CAMPAIGN: str(campaign_id)}
        extra = {str(k): str(v) for k, v in (tags or {}).items()}
        run = self._find_run(experiment_id, key)
        if run is not None:
            run_id = self._continue(run)
            if extra:
                self._set_tags(run_id, extra)
            return run_id
        return self.client.create_run(experiment_id, run_name=name,
                                      tags={**extra, **key}).info.run_id

    @_tolerant("start_candidate_run")
    def start_candidate_run(self, experiment_id: str, parent_run_id: str | None, *,
                            campaign_id: str, stage: str, candidate: str, recipe: Any,
                            recipe_hash: str, mode: str) -> str:
        """A candidate's child run, params = the flattened recipe. The run with the same
        (campaign_id, stage, candidate, recipe_hash) is continued when it exists."""
        assert self.client is not None
        key = {TAG_KIND: "candidate", TAG_CAMPAIGN: str(campaign_id), TAG_STAGE: str(stage),
               TAG_CANDIDATE: str(candidate), TAG_RECIPE_HASH: str(recipe_hash)}
        data = _recipe_dict(recipe)
        params = flatten_params(data)
        run = self._find_run(experiment_id, key)
        if run is not None:
            run_id = self._continue(run)
            params = {k: v for k, v in params.items() if k not in run.data.params}
        else:
            tags = {**key, TAG_MODE: str(mode)}
            if parent_run_id:
                tags[_PARENT_TAG] = parent_run_id
            if data.get("name"):
                tags["asyncrl.recipe_name"] = str(data["name"])
            run_id = self.client.create_run(experiment_id, run_name=f"{stage}/{candidate}",
                                            tags=tags).info.run_id
            self._log_json(run_id, data, "recipe.json")
        self._log_params(run_id, params)
        return run_id

    def _log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        assert self.client is not None
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i:i + PARAMS_PER_BATCH])

    def _set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        assert self.client is not None
        items = [RunTag(str(k), str(v)[:_TAG_VALUE_MAX]) for k, v in tags.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, tags=items[i:i + PARAMS_PER_BATCH])

    def _log_json(self, run_id: str, data: Any, name: str) -> None:
        assert self.client is not None
        path = Path(name)
        with tempfile.TemporaryDirectory(prefix="asyncrl-mlflow-") as tmp:
            local = Path(tmp) / path.name
            local.write_text(json.dumps(data, indent=2, default=str))
            parent = path.parent.as_posix()
            self.client.log_artifact(run_id, str(local), None if parent in ("", ".") else parent)

    # --- metrics ----------------------------------------------------------------------------
    def sink(self, run_id: str | None) -> MLflowSink | NullSink:
        """A metrics sink for the run. Tracking off (no client, or ``run_id`` is None after an
        earlier failure) gives a :class:`~training.runtime.sinks.NullSink`, so callers never
        branch on it."""
        if self.client is None or not run_id:
            log.warning("MLflow metrics off for this run (%s)",
                        self.error or "no MLflow run id")
            return NullSink()
        return MLflowSink(self.client, run_id)

    # --- artifacts, tags, status ------------------------------------------------------------
    @_tolerant("log_artifact_file")
    def log_artifact_file(self, run_id: str, path: str | os.PathLike[str],
                          artifact_path: str | None = None) -> None:
        assert self.client is not None
        self.client.log_artifact(run_id, str(path), artifact_path)

    @_tolerant("log_dict")
    def log_dict(self, run_id: str, data: Mapping[str, Any], name: str) -> None:
        """``data`` as a JSON artifact ``name`` (may contain folders, e.g. ``gates/report.json``);
        values JSON cannot hold are written with ``str``."""
        self._log_json(run_id, data, name)

    @_tolerant("set_tags")
    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        self._set_tags(run_id, tags)

    @_tolerant("log_metrics")
    def log_metrics(self, run_id: str, metrics: Mapping[str, Any], step: int = 0) -> None:
        """Log finite ``metrics`` at ``step`` (keys through :func:`metric_key`)."""
        from mlflow.entities import Metric

        assert self.client is not None
        now = int(time.time() * 1000)
        items = [Metric(metric_key(k), v, now, step) for k, raw in metrics.items()
                 if (v := _finite(raw)) is not None]
        if items:
            self.client.log_batch(run_id, metrics=items)

    @_tolerant("end_run")
    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Mark the run FINISHED, FAILED or KILLED."""
        assert self.client is not None
        self.client.set_terminated(run_id, status=status)

    # --- model registry ---------------------------------------------------------------------
    @_tolerant("register_model")
    def register_model(self, name: str, run_id: str, checkpoint_dir: str | os.PathLike[str], *,
                       aliases: Iterable[str] = (), description: str | None = None,
                       tags: Mapping[str, Any] | None = None) -> str:
        """Register ``checkpoint_dir`` (a Hugging Face directory) as a version of model ``name``
        and point each alias at it. The directory is logged under the run's ``checkpoint``
        artifact path and the version's source is ``runs:/<run_id>/checkpoint``; when a version
        with that source exists it is reused (nothing is uploaded again) and only the aliases are
        set. ``description`` and ``tags`` are put on the version (new or reused). Returns the
        version number as a string."""
        assert self.client is not None
        source = f"runs:/{run_id}/{CHECKPOINT_ARTIFACT}"
        existing = [v for v in self.client.search_model_versions(f"run_id = '{run_id}'")
                    if v.name == name and v.source == source]
        if existing:
            version = str(min(int(v.version) for v in existing))
        else:
            ckpt = Path(checkpoint_dir)
            if not ckpt.is_dir():
                raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist")
            self.client.log_artifacts(run_id, str(ckpt), CHECKPOINT_ARTIFACT)
            try:
                self.client.get_registered_model(name)
            except Exception:
                self.client.create_registered_model(name)
            mv = self.client.create_model_version(
                name, source, run_id=run_id, tags={"asyncrl.checkpoint_dir": str(ckpt)})
            version = str(mv.version)
        for alias in aliases:
            self.client.set_registered_model_alias(name, re.sub(r"[^\w\-]", "-", alias),
                                                   version)
        try:  # what the version says of itself: never at the cost of the aliases above
            if description:
                self.client.update_model_version(name, version, description=description)
            for key, value in (tags or {}).items():
                self.client.set_model_version_tag(name, version, str(key), str(value))
        except Exception as e:
            log.warning("MLflow model %s version %s: description/tags not set (%s)", name,
                        version, e)
        return version

    @_tolerant("run_url")
    def run_url(self, run_id: str) -> str:
        """A browser link to the run (on :func:`ui_base_url`)."""
        assert self.client is not None
        exp = self.client.get_run(run_id).info.experiment_id
        return f"{ui_base_url(self.tracking_uri)}/#/experiments/{exp}/runs/{run_id}"

    @_tolerant("compare_url")
    def compare_url(self, run_ids: list[str]) -> str:
        """A browser link to MLflow's run comparison of ``run_ids``. MLflow's page needs both
        ``runs`` and ``experiments`` (JSON lists; without ``experiments`` it shows
        ``"undefined" is not valid JSON``)."""
        assert self.client is not None
        experiments = list(dict.fromkeys(self.client.get_run(r).info.experiment_id
                                         for r in run_ids))
        query = urllib.parse.urlencode({
            "runs": json.dumps(list(run_ids), separators=(",", ":")),
            "experiments": json.dumps(experiments, separators=(",", ":"))})
        return f"{ui_base_url(self.tracking_uri)}/#/compare-runs?{query}"


class TrackedRun:
    """One MLflow run of a campaign — its parent run or a candidate's child run — or no run at
    all (tracking off, or MLflow failed to start it): :attr:`id` is None then and every method
    does nothing, so the campaign flow never branches on tracking (a null object).

    Made by :meth:`Tracker.campaign_run` and :meth:`candidate_run`; failures after that are
    tolerated as :class:`Tracker`'s are (a warning, never the campaign).
    """

    def __init__(self, tracker: Tracker, experiment_id: str | None, run_id: str | None) -> None:
        self.tracker = tracker
        self.experiment_id = experiment_id
        self.id = run_id if experiment_id else None

    def candidate_run(self, *, campaign_id: str, stage: str, candidate: str, recipe: Any,
                      recipe_hash: str, mode: str) -> TrackedRun:
        """The child run of one candidate (:meth:`Tracker.start_candidate_run`), with its
        recipe as ``recipe.json``; no run when this one is none."""
        if self.id is None:
            return TrackedRun(self.tracker, None, None)
        child = self.tracker.start_candidate_run(
            self.experiment_id, self.id, campaign_id=campaign_id, stage=stage,
            candidate=candidate, recipe=recipe, recipe_hash=recipe_hash, mode=mode)
        run = TrackedRun(self.tracker, self.experiment_id, child)
        run.log_dict(_recipe_dict(recipe), "recipe.json")
        return run

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.id is not None:
            self.tracker.set_tags(self.id, tags)

    def log_dict(self, data: Mapping[str, Any], name: str) -> None:
        if self.id is not None:
            self.tracker.log_dict(self.id, data, name)

    def log_file(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        if self.id is not None:
            self.tracker.log_artifact_file(self.id, path, artifact_path)

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0) -> None:
        if self.id is not None:
            self.tracker.log_metrics(self.id, metrics, step)

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run FINISHED, FAILED or KILLED."""
        if self.id is not None:
            self.tracker.end_run(self.id, status)


class MLflowSink:
    """A :class:`~training.runtime.sinks.MetricsSink` that sends metrics to one MLflow run with
    one ``log_batch`` per <= 999 points of whole steps (plus the watermark tag, see the module
    docstring).

    Points are sent at step boundaries: when ``flush_every`` steps or ``flush_seconds`` have
    passed since the last send, or as soon as a full batch of finished steps is buffered, and at
    :meth:`close`. Non-finite and non-numeric values are skipped; keys pass through
    :func:`metric_key`. Steps are expected in non-decreasing order (the trainer's order). A
    failed request keeps its points, and the next try waits ``flush_seconds`` (or :meth:`close`);
    after ``max_failures`` failures in a row, or one that took over a minute (an unreachable
    server, after MLflow's own HTTP retries), the sink turns itself off with a warning so the
    trainer is never held up again. MLflow's watermark still tells a later :meth:`log_history`
    where to resume.

    Args:
        client: an ``MlflowClient``.
        run_id: the run to log to. Its ``asyncrl.logged_until_step`` tag is read once here, and
            steps up to it are skipped (already in MLflow).
    """

    def __init__(self, client: MlflowClient, run_id: str, *, flush_every: int = 50,
                 flush_seconds: float = 30.0, max_failures: int = 3) -> None:
        if flush_every < 1:
            raise ValueError(f"MLflowSink(flush_every={flush_every}): must be >= 1")
        self.client = client
        self.run_id = run_id
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self.max_failures = max_failures
        self.disabled = False
        self._failures = 0
        self._retry_after = 0.0
        self._done: list[Metric] = []  # points of finished steps, in step order
        self._done_through: int | None = None  # the last finished step
        self._open: list[Metric] = []  # points of the step still being logged
        self._open_step: int | None = None
        self._steps_since_send = 0
        self._last_send = time.monotonic()
        self._skipped_steps: set[int] = set()
        self.logged_until_step = self._read_watermark()

    def _read_watermark(self) -> int:
        """The last step whose points are all in MLflow: the watermark tag, or the step mark's
        highest step when the tag fell behind (:data:`STEP_MARK`)."""
        try:
            tag = self.client.get_run(self.run_id).data.tags.get(TAG_LOGGED_UNTIL)
            marks = self.client.get_metric_history(self.run_id, STEP_MARK)
            return max([int(tag) if tag is not None else -1] + [int(m.step) for m in marks])
        except Exception as err:  # tolerated: assume a fresh run
            log.warning("MLflow run %s: could not read %s (%s: %s); assuming nothing is logged "
                        "yet", self.run_id, TAG_LOGGED_UNTIL, type(err).__name__, err)
            return -1

    # --- MetricsSink ------------------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._add(int(step), metrics, int(time.time() * 1000))
        if self._open_step is None or time.monotonic() < self._retry_after:
            return
        if len(self._done) >= BATCH_POINTS:
            self._send(full_batches_only=True)
        if self._done and (self._steps_since_send >= self.flush_every
                           or time.monotonic() - self._last_send >= self.flush_seconds):
            self._send()

    def close(self) -> None:
        """Send everything buffered (the last step counts as finished)."""
        self._finish_open_step()
        self._send()
        if self._done and not self.disabled:
            log.warning("MLflow run %s: %d metric points could not be sent; metrics.jsonl has "
                        "them (replay with log_history)", self.run_id, len(self._done))
        if self._skipped_steps:
            log.info("MLflow run %s: %d steps up to step %d were already logged and were skipped "
                     "(metrics.jsonl holds their latest values)", self.run_id,
                     len(self._skipped_steps), max(self._skipped_steps))
            self._skipped_steps.clear()

    def log_history(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Replay ``metrics.jsonl`` records (:func:`~training.runtime.sinks.read_metrics`) and
        send them, with the records' own timestamps. Steps <= the run's watermark are skipped, so
        replaying the same history twice logs each point once."""
        for row in rows:
            stamp = row.get("time")
            ms = int(float(stamp) * 1000) if isinstance(stamp, int | float) else \
                int(time.time() * 1000)
            metrics = {k: v for k, v in row.items() if k not in _RESERVED_ROW_KEYS}
            self._add(int(row["step"]), metrics, ms)
            if len(self._done) >= BATCH_POINTS and time.monotonic() >= self._retry_after:
                self._send(full_batches_only=True)
        self.close()

    # --- buffering --------------------------------------------------------------------------
    def _add(self, step: int, metrics: Mapping[str, Any], timestamp_ms: int) -> None:
        from mlflow.entities import Metric

        if self.disabled:
            return
        if step <= self.logged_until_step:
            self._skipped_steps.add(step)
            return
        if self._open_step is not None and step != self._open_step:
            self._finish_open_step()
        self._open_step = step
        for key, value in metrics.items():
            v = _finite(value)
            if v is not None:
                self._open.append(Metric(metric_key(key), v, timestamp_ms, step))

    def _finish_open_step(self) -> None:
        from mlflow.entities import Metric

        if self._open_step is None:
            return
        if self._open:  # the step's last point: what a resume reads back (STEP_MARK)
            self._open.append(Metric(STEP_MARK, float(self._open_step), self._open[-1].timestamp,
                                     self._open_step))
        self._done.extend(self._open)
        self._done_through = self._open_step if self._done_through is None \
            else max(self._done_through, self._open_step)
        self._open, self._open_step = [], None
        self._steps_since_send += 1

    def _send(self, *, full_batches_only: bool = False) -> None:
        """Send finished steps, one ``log_batch`` per chunk; each chunk carries the watermark it
        completes, so the tag is never ahead of the points actually stored."""
        from mlflow.entities import RunTag

        while not self.disabled and (self._done or self._watermark_behind()):
            if full_batches_only and len(self._done) < BATCH_POINTS:
                return
            cut = self._cut()
            chunk, rest = self._done[:cut], self._done[cut:]
            mark = rest[0].step - 1 if rest else self._done_through
            tags = []
            if mark is not None and mark > self.logged_until_step:
                tags = [RunTag(TAG_LOGGED_UNTIL, str(mark))]
            started = time.monotonic()
            try:
                self.client.log_batch(self.run_id, metrics=chunk, tags=tags)
            except Exception as err:  # tolerated: tracking must not stop training
                self._failures += 1
                self._retry_after = time.monotonic() + self.flush_seconds
                slow = time.monotonic() - started > _SLOW_FAILURE_S
                if self._failures >= self.max_failures or slow:
                    self.disabled = True
                    log.warning(
                        "MLflow run %s: %d failed sends in a row (last: %s: %s); the MLflow "
                        "sink is off for the rest of this run, dropping %d points. metrics.jsonl "
                        "keeps everything; replay it with Tracker.sink(run_id).log_history(...)",
                        self.run_id, self._failures, type(err).__name__, err, len(self._done))
                    self._done, self._open = [], []
                else:
                    log.warning("MLflow run %s: sending %d metric points failed (%s: %s); "
                                "retrying at the next flush", self.run_id, len(chunk),
                                type(err).__name__, err)
                return
            self._failures = 0
            self._retry_after = 0.0
            self._done = rest
            if tags:
                self.logged_until_step = int(tags[0].value)
            self._steps_since_send = 0
            self._last_send = time.monotonic()

    def _cut(self) -> int:
        """How many buffered points the next request takes: at most one batch, ending at a step
        boundary so that a crash never leaves part of a step above the watermark (only a single
        step with more than a batch of metrics is split)."""
        done = self._done
        if len(done) <= BATCH_POINTS:
            return len(done)
        cut = BATCH_POINTS
        while cut > 0 and done[cut].step == done[cut - 1].step:
            cut -= 1
        return cut or BATCH_POINTS

    def _watermark_behind(self) -> bool:
        """Finished steps without points (all values non-finite) still move the watermark."""
        return self._done_through is not None and self._done_through > self.logged_until_step
