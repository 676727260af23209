"""`asyncrl up` / `down` (local Prefect and MLflow servers), `asyncrl deploy` (serve a campaign
as a Prefect deployment) and `asyncrl compare` (two run directories side by side).

Nothing needs a server (DESIGN.md "Services"): ``up`` is for people who want the UIs. It starts
the servers in the background on 127.0.0.1, each in its own session (process group), logs to
``$ASYNCRL_HOME/logs/<service>-server.log`` and records what it started in
``$ASYNCRL_HOME/services.json``; ``down`` stops exactly those process groups and nothing else.
Lazy imports and one-line ``error: …`` messages, as in the other command modules.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from datetime import UTC
from pathlib import Path
from typing import Any

import typer

from ui.common import (
    DEFAULT_DASHBOARD_PORT,
    DEFAULT_MLFLOW_PORT,
    DEFAULT_PREFECT_PORT,
    HOST,
    answers,
    fail,
    require_state_dir,
)

RECORD_FILE = "services.json"
STOP_GRACE_S = 15.0


# --- process bookkeeping ------------------------------------------------------------------------


def _record_path() -> Path:
    from training.paths import state_dir

    return state_dir() / RECORD_FILE


def _load_record() -> dict[str, dict[str, Any]]:
    path = _record_path()
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        fail(f"{path} is not readable JSON; stop the servers it named by hand and delete it")
    return data if isinstance(data, dict) else {}


def _save_record(data: dict[str, dict[str, Any]]) -> None:
    path = _record_path()
    if not data:
        path.unlink(missing_ok=True)
        return
    from training.fileio import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=2) + "\n")  # the PIDs `down` stops


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 0 = state), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def _start_ticks(pid: int) -> str | None:
    """The process's start time (clock ticks since boot): with the PID it names one process, so
    a PID reused by another program is never taken for ours. None where /proc is missing."""
    stat = _proc_stat(pid)
    return stat[19] if stat and len(stat) > 19 else None


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is a child of this process and has exited (else a zombie stays)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _pid_alive(pid: int) -> bool:
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _proc_stat(pid)
    return not (stat and stat[0] in ("Z", "X"))


def _is_ours(entry: dict[str, Any]) -> bool:
    """The recorded process is alive and is the one ``up`` started (same start time)."""
    pid = int(entry.get("pid", 0))
    if pid <= 0 or not _pid_alive(pid):
        return False
    want = entry.get("proc_start")
    return want is None or _start_ticks(pid) in (None, want)


def _group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the process group ``pgid``."""
    _reap(pgid)
    if Path("/proc").is_dir():
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            stat = _proc_stat(int(d.name))
            if stat and len(stat) > 2 and stat[2] == str(pgid) and stat[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _stop_groups(pgids: list[int], grace: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM each group, wait up to ``grace`` s, SIGKILL what is left; → groups still alive."""
    for g in pgids:
        _signal_group(g, signal.SIGTERM)
    deadline = time.monotonic() + grace
    left = [g for g in pgids if _group_alive(g)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [g for g in left if _group_alive(g)]
    for g in left:
        _signal_group(g, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [g for g in left if _group_alive(g)]
    return left


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


# --- the services -------------------------------------------------------------------------------


def _mlflow_store(uri: str | None = None) -> str:
    """The store to serve: ``uri`` (``--mlflow-backend-store-uri``) when given, else the store
    the runs write to (flows.tracking): MLFLOW_TRACKING_URI when it names one (a database such
    as PostgreSQL), but a server URL there (what ``up`` tells users to set) is not a store, so
    the local SQLite default is served then."""
    from flows.tracking import default_tracking_uri
    from registry.db import with_psycopg3  # a bare postgresql:// means psycopg 3

    if uri:
        return with_psycopg3(uri)
    saved = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not saved.startswith(("http://", "https://")):
        return with_psycopg3(default_tracking_uri())
    del os.environ["MLFLOW_TRACKING_URI"]
    try:
        return default_tracking_uri()
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = saved


def _prefect_home() -> Path:
    from flows.environment import prefect_defaults

    return Path(os.environ.get("PREFECT_HOME") or prefect_defaults()["PREFECT_HOME"])


def service_spec(name: str, port: int, store: str | None = None) -> dict[str, Any]:
    """How to start service ``name`` on ``port``: command, extra environment, health and UI
    URLs, and the env var that points runs at it. ``store``: MLflow's backend store (default
    :func:`_mlflow_store`); it reaches the server in its environment, not on its command line,
    so a database password stays out of ``ps``, the log and services.json (which show it
    redacted)."""
    import sys

    base = f"http://{HOST}:{port}"
    if name == "prefect":
        home = _prefect_home()
        home.mkdir(parents=True, exist_ok=True)
        return {"command": [sys.executable, "-m", "prefect", "server", "start", "--host", HOST,
                            "--port", str(port)],
                "env": {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
                "unset": ["PREFECT_API_URL"],
                "health": f"{base}/api/health", "url": base,
                "export": ("PREFECT_API_URL", f"{base}/api"), "option": "--prefect-port"}
    if name == "mlflow":
        from flows.tracking import default_artifact_root, redact_uri

        # a database store keeps artifacts in the local directory of the SQLite default too;
        # clients on this machine write them there directly (file:// experiment locations)
        backend = _mlflow_store(store)
        return {"command": [sys.executable, "-m", "mlflow", "server", "--host", HOST, "--port",
                            str(port), "--default-artifact-root", default_artifact_root(),
                            "--workers", "1"],
                "env": {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                        "MLFLOW_BACKEND_STORE_URI": backend},
                "unset": [], "store": redact_uri(backend),
                "health": f"{base}/health", "url": base,
                "export": ("MLFLOW_TRACKING_URI", base), "option": "--mlflow-port"}
    if name == "dashboard":
        return {"command": [sys.executable, "-m", "ui.dashboard", "--port", str(port)],
                "env": {}, "unset": [], "health": f"{base}/health", "url": base,
                "export": None, "option": "--dashboard-port"}
    raise ValueError(f"unknown service {name!r}")


def _spawn(name: str, spec: dict[str, Any], port: int) -> dict[str, Any]:
    import subprocess
    from datetime import datetime

    from training.paths import state_dir

    logs = state_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}-server.log"
    env = {k: v for k, v in os.environ.items() if k not in spec["unset"]}
    env.update(spec["env"])
    with open(log_path, "ab") as log:
        store = f" (store {spec['store']})" if spec.get("store") else ""
        log.write(f"\n--- asyncrl up {datetime.now(UTC).isoformat()}: "
                  f"{' '.join(spec['command'])}{store}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(spec["command"], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=state_dir(),
                                    start_new_session=True)
        except OSError as e:
            fail(f"cannot start the {name} server: {e}")
    return {"pid": proc.pid, "pgid": proc.pid, "proc_start": _start_ticks(proc.pid),
            "port": port, "url": spec["url"], "health": spec["health"],
            "export": f"{spec['export'][0]}={spec['export'][1]}" if spec["export"] else None,
            "command": spec["command"], "log": str(log_path),
            **({"store": spec["store"]} if spec.get("store") else {}),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds")}


def _wait_ready(started: dict[str, dict[str, Any]], timeout: float) -> None:
    """Poll each new server's health URL; on an early exit or a timeout stop every server this
    call started, drop them from the record and fail with the log's path."""
    from rich.console import Console

    pending = dict(started)
    deadline = time.monotonic() + timeout
    problem: str | None = None
    with Console(stderr=True).status(f"starting {', '.join(pending)} …") as status:
        while pending and problem is None:
            for name, entry in list(pending.items()):
                if answers(entry["health"]):
                    del pending[name]
                elif not _pid_alive(entry["pid"]):
                    problem = (f"the {name} server exited while starting; see "
                               f"{entry['log']}")
                    break
            if pending and problem is None:
                if time.monotonic() > deadline:
                    name = next(iter(pending))
                    problem = (f"the {name} server did not answer within {timeout:.0f} s; see "
                               f"{pending[name]['log']} (slow machine? retry with --timeout)")
                    break
                status.update(f"starting {', '.join(pending)} …")
                time.sleep(0.3)
    if problem is not None:
        _stop_groups([e["pgid"] for e in started.values()], grace=5.0)
        record = _load_record()
        for name in started:
            record.pop(name, None)
        _save_record(record)
        fail(problem)


def up(
    prefect_port: int = typer.Option(DEFAULT_PREFECT_PORT, "--prefect-port",
                                     help="Port of the Prefect server (API and UI)."),
    mlflow_port: int = typer.Option(DEFAULT_MLFLOW_PORT, "--mlflow-port",
                                    help="Port of the MLflow server (tracking API and UI)."),
    no_prefect: bool = typer.Option(False, "--no-prefect", help="Do not start Prefect."),
    no_mlflow: bool = typer.Option(False, "--no-mlflow", help="Do not start MLflow."),
    dashboard_port: int = typer.Option(DEFAULT_DASHBOARD_PORT, "--dashboard-port",
                                       help="Port of the asyncrl dashboard."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard",
                                      help="Do not start the dashboard."),
    mlflow_store: str | None = typer.Option(
        None, "--mlflow-backend-store-uri", metavar="URI",
        help="The store the MLflow server serves, e.g. postgresql://user:pass@host:5432/db "
             "(psycopg 3 driver). Default: MLFLOW_TRACKING_URI when it names a database, else "
             "sqlite:///$ASYNCRL_HOME/mlflow/mlflow.db. Artifacts go to "
             "$ASYNCRL_HOME/mlflow/artifacts either way."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for each server."),
) -> None:
    """Start the local Prefect server, MLflow server and asyncrl dashboard in the background on
    127.0.0.1 (state under $ASYNCRL_HOME, logs in $ASYNCRL_HOME/logs); `asyncrl down` stops
    them. MLflow serves a database store (SQLite by default, or PostgreSQL:
    --mlflow-backend-store-uri); the dashboard links to both."""
    wanted = {n: p for n, p, off in (("prefect", prefect_port, no_prefect),
                                     ("mlflow", mlflow_port, no_mlflow),
                                     ("dashboard", dashboard_port, no_dashboard)) if not off}
    if not wanted:
        fail("nothing to start: drop --no-prefect, --no-mlflow or --no-dashboard")
    ports: dict[int, str] = {}
    for name, port in wanted.items():
        if port in ports:
            fail(f"--{ports[port]}-port and --{name}-port are both {port}; choose two ports")
        ports[port] = name
    require_state_dir()
    record = _load_record()
    running: list[str] = []
    to_start: dict[str, dict[str, Any]] = {}
    for name, port in wanted.items():
        extra = {"store": mlflow_store} if name == "mlflow" and mlflow_store else {}
        entry = record.get(name)
        if entry is not None and _is_ours(entry):
            if int(entry["port"]) != port:
                fail(f"{name} is already running on port {entry['port']} (pid {entry['pid']}); "
                      f"`asyncrl down` first to move it to port {port}")
            if extra and entry.get("store"):
                from flows.tracking import redact_uri

                want = redact_uri(_mlflow_store(mlflow_store))
                if entry["store"] != want:
                    fail(f"mlflow is already running on store {entry['store']} (pid "
                          f"{entry['pid']}); `asyncrl down` first to serve {want}")
            running.append(name)
            continue
        record.pop(name, None)  # a stale entry: the process is gone
        if not 0 < port < 65536:
            fail(f"port {port} is not a valid port; choose another with "
                  f"--{name}-port")
        spec = service_spec(name, port, **extra)
        if not _port_free(port):
            fail(f"port {port} on {HOST} is already in use (wanted for {name}); choose another "
                  f"with {spec['option']} or stop what uses it")
        to_start[name] = spec

    started: dict[str, dict[str, Any]] = {}
    for name, spec in to_start.items():
        started[name] = record[name] = _spawn(name, spec, wanted[name])
        _save_record(record)  # recorded at once: `asyncrl down` finds it even if we die now
    if started:
        _wait_ready(started, timeout)

    for name in wanted:
        e = record[name]
        how = "already running" if name in running else "started"
        store = f", store {e['store']}" if e.get("store") else ""
        typer.echo(f"{name}: {how} — UI {e['url']} (pid {e['pid']}, log {e['log']}{store})")
    exports = [record[n]["export"] for n in wanted if record[n].get("export")]
    if exports:
        typer.echo("Point runs at them (in the shell that runs asyncrl):")
        for line in exports:
            typer.echo(f"  export {line}")
    typer.echo("Stop them with `asyncrl down`.")


def down() -> None:
    """Stop the servers `asyncrl up` started (their process groups, by recorded PID; SIGTERM,
    SIGKILL after 15 s). Stop `asyncrl deploy` processes (Ctrl-C) first: served flows hang when
    their server goes away."""
    record = _load_record()
    if not record:
        typer.echo("nothing to stop")
        return
    live = {n: e for n, e in record.items() if isinstance(e, dict) and _is_ours(e)}
    for name in record:
        if name not in live:
            typer.echo(f"{name}: not running (stale record)")
    left = _stop_groups([int(e.get("pgid", e["pid"])) for e in live.values()])
    remaining = {n: e for n, e in live.items() if int(e.get("pgid", e["pid"])) in left}
    for name, e in live.items():
        if name not in remaining:
            typer.echo(f"{name}: stopped (pid {e['pid']})")
    _save_record(remaining)
    if remaining:
        fail("could not stop " + ", ".join(f"{n} (process group {e.get('pgid', e['pid'])})"
                                            for n, e in remaining.items()))


# --- deploy -------------------------------------------------------------------------------------


def deploy(
    path: Path = typer.Argument(..., metavar="CAMPAIGN.yaml", help="Campaign file."),
    cron: str | None = typer.Option(None, "--cron", help="Cron schedule, e.g. '0 3 * * *' "
                                    "(default: no schedule, runs on demand)."),
    interval: float | None = typer.Option(
        None, "--interval", min=1.0, help="Run every this many seconds (an interval schedule; "
        "instead of --cron)."),
    name: str | None = typer.Option(None, "--name", help="Deployment name (default: the "
                                    "campaign's name)."),
) -> None:
    """Serve the campaign as a Prefect deployment on the server at PREFECT_API_URL, in the
    foreground (Ctrl-C stops serving). Each run is a new campaign; runs go one at a time (a
    scheduled run waits while another campaign trains). Trigger one from the UI or with
    `prefect deployment run 'asyncrl-scheduled-campaign/NAME'`."""
    if cron is not None and interval is not None:
        fail("--cron and --interval are two schedules; pass one")
    from registry.campaign import CampaignError, load_campaign

    try:
        campaign, _ = load_campaign(path)
    except CampaignError as e:
        fail(str(e))
    api = os.environ.get("PREFECT_API_URL", "").strip()
    hint = (f"start one with `asyncrl up` and set PREFECT_API_URL=http://{HOST}:"
            f"{DEFAULT_PREFECT_PORT}/api")
    if not api:
        fail(f"deploy needs a Prefect server and PREFECT_API_URL is not set; {hint}")
    if not answers(api.rstrip("/") + "/health"):
        fail(f"no Prefect server answers at PREFECT_API_URL={api}; {hint}")
    if cron is not None:
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(cron=cron)
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            errors = getattr(e, "errors", None)
            why = errors()[0].get("msg", "") if callable(errors) and errors() else str(e)
            fail(f"--cron {cron!r} is not a valid cron expression ({why.splitlines()[0]}); "
                  "e.g. '0 3 * * *' (minute hour day month weekday)")
    deployment = name or campaign.name

    from training.paths import ENV_VAR, state_path
    require_state_dir()
    os.environ[ENV_VAR] = str(state_path())  # flow runs start in subprocesses: pin this one
    from flows.deploy import FLOW_NAME, scheduled_campaign_flow  # configures Prefect first

    full = f"{FLOW_NAME}/{deployment}"
    schedule = (f"cron '{cron}'" if cron else f"every {interval:g} s" if interval else None)
    typer.echo(f"serving deployment '{full}' on {api}"
               + (f" ({schedule})" if schedule else " (no schedule; runs on demand)"))
    typer.echo(f"  run it now: prefect deployment run '{full}'")
    typer.echo("  Ctrl-C stops serving" + (" (and pauses the schedule)." if schedule else "."))
    with contextlib.suppress(KeyboardInterrupt):
        scheduled_campaign_flow.serve(
            name=deployment, cron=cron, interval=interval, limit=1,
            parameters={"campaign_path": str(Path(path).resolve())},
            tags=["asyncrl", f"campaign:{campaign.name}"],
            print_starting_message=False)
    typer.echo("stopped serving")


# --- compare ------------------------------------------------------------------------------------


def _run_files(run: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import yaml

    if not run.is_dir():
        fail(f"{run} is not a directory; pass two run directories (written by asyncrl train "
              "or a campaign)")
    out = []
    for fname in ("summary.json", "recipe.yaml"):
        p = run / fname
        if not p.is_file():
            fail(f"{run} has no {fname}; pass a finished run directory")
        try:
            data = json.loads(p.read_text()) if fname.endswith(".json") \
                else yaml.safe_load(p.read_text())
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            fail(f"{p} cannot be parsed: {str(e).splitlines()[0]}")
        if not isinstance(data, dict):
            fail(f"{p} does not hold a mapping")
        out.append(data)
    return out[0], out[1]


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings/lists → {dotted.key: leaf}; list items are keyed by index."""
    if isinstance(data, dict) and data:
        items = ((str(k), v) for k, v in data.items())
    elif isinstance(data, list) and data:
        items = ((str(i), v) for i, v in enumerate(data))
    else:
        return {prefix: data} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal values; a number also equals a string that parses to it ('1e-5', a string to
    YAML 1.1, against 1.0e-05)."""
    if a == b:
        return True
    if (_num(a) and isinstance(b, str)) or (_num(b) and isinstance(a, str)):
        try:
            return float(a) == float(b)
        except ValueError:
            return False
    return False


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def compare_runs(a: Path, b: Path) -> dict[str, Any]:
    """The comparison ``asyncrl compare`` prints: per summary metric a/b/delta, the recipe keys
    whose values differ (a side is left out where the key is absent), the MLflow compare link."""
    sa, ra = _run_files(a)
    sb, rb = _run_files(b)
    summary: dict[str, dict[str, Any]] = {}
    for key in sorted(set(sa) | set(sb)):
        row: dict[str, Any] = {}
        if key in sa:
            row["a"] = sa[key]
        if key in sb:
            row["b"] = sb[key]
        if _num(row.get("a")) and _num(row.get("b")):
            row["delta"] = row["b"] - row["a"]
        summary[key] = row
    fa, fb = flatten(ra), flatten(rb)
    diff: dict[str, dict[str, Any]] = {}
    for key in sorted(set(fa) | set(fb)):
        if key in fa and key in fb and _same(fa[key], fb[key]):
            continue
        diff[key] = {**({"a": fa[key]} if key in fa else {}),
                     **({"b": fb[key]} if key in fb else {})}
    return {"a": str(a), "b": str(b), "summary": summary, "recipe_diff": diff,
            "mlflow_compare_url": _mlflow_compare_url(a, b)}


def _mlflow_run_ids(run_dirs: list[Path]) -> list[str | None]:
    """The MLflow run of each run directory, from the registry's campaign runs (None: unknown).
    Read-only: a registry that does not exist yet is not created. The link is optional, so a
    registry that cannot be read gives no link rather than an error."""
    from sqlalchemy.exc import SQLAlchemyError

    from registry.db import RegistryError, open_existing

    ids: list[str | None] = [None] * len(run_dirs)
    try:
        db = open_existing(upgrade=False)
    except (RegistryError, SQLAlchemyError, OSError):
        return ids
    if db is None:
        return ids
    wanted = {p.resolve(): i for i, p in enumerate(run_dirs)}
    # a campaign run lives in $ASYNCRL_HOME/campaigns/<id>/<stage>/<candidate>: look there first
    first = list(dict.fromkeys(p.parent.parent.name for p in wanted))
    try:
        def scan(campaign_ids: list[str]) -> None:
            for cid in campaign_ids:
                for r in db.runs(cid):
                    i = wanted.get(Path(r.run_dir).resolve()) if r.run_dir else None
                    if i is not None and r.mlflow_run_id:
                        ids[i] = r.mlflow_run_id

        scan(first)
        if not all(ids):
            scan([c.id for c in db.list_campaigns() if c.id not in first])
    except (RegistryError, SQLAlchemyError, OSError):
        pass
    finally:
        db.close()
    return ids


def _mlflow_compare_url(a: Path, b: Path) -> str | None:
    ids = _mlflow_run_ids([a, b])
    if not all(ids):
        return None
    from flows.tracking import Tracker

    return Tracker().compare_url([str(i) for i in ids])


def _fmt(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, dict | list):
        return json.dumps(v)
    return str(v)


def compare(
    run_a: Path = typer.Argument(..., metavar="RUN_A", help="Run directory."),
    run_b: Path = typer.Argument(..., metavar="RUN_B", help="Run directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Two runs side by side: summary metrics (a, b, b − a), the recipe keys that differ, and
    the MLflow compare link when both are campaign runs in the registry."""
    out = compare_runs(run_a, run_b)
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    con.print(f"A = {escape(out['a'])}\nB = {escape(out['b'])}")
    t = Table(title="summary")
    t.add_column("metric", overflow="fold")
    for c in ("A", "B", "B − A"):
        t.add_column(c, justify="right", overflow="fold")
    for key, row in out["summary"].items():
        t.add_row(escape(key), *(escape(_fmt(row[k])) if k in row else "—"
                                 for k in ("a", "b", "delta")))
    con.print(t)
    if out["recipe_diff"]:
        d = Table(title="recipe differences")
        for c in ("key", "A", "B"):
            d.add_column(c, overflow="fold")
        for key, row in out["recipe_diff"].items():
            d.add_row(escape(key), *(escape(_fmt(row[k])) if k in row else "(absent)"
                                     for k in ("a", "b")))
        con.print(d)
    else:
        con.print("recipes: identical")
    if out["mlflow_compare_url"]:
        con.print(f"MLflow: {out['mlflow_compare_url']}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Attach `up`, `down`, `deploy` and `compare` to the main CLI."""
    app.command("up")(up)
    app.command("down")(down)
    app.command("deploy")(deploy)
    app.command("compare")(compare)
