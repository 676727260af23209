"""`asyncrl dashboard`: serve the read-only campaign dashboard (:mod:`ui.dashboard.app`) in the
foreground on 127.0.0.1 (``asyncrl up`` also starts it in the background)."""

from __future__ import annotations

import typer

from ui.common import DEFAULT_DASHBOARD_PORT, HOST, fail


def dashboard(
    port: int = typer.Option(DEFAULT_DASHBOARD_PORT, "--port", help="Port to serve on."),
    host: str = typer.Option(HOST, "--host", help="Address to bind (loopback by default; "
                             "0.0.0.0 shows it to your network)."),
    registry_url: str | None = typer.Option(
        None, "--registry-url", metavar="URL", help="The registry to read (default: "
        "ASYNCRL_REGISTRY_URL, else $ASYNCRL_HOME/registry.db)."),
    mlflow_url: str | None = typer.Option(
        None, "--mlflow-url", metavar="URL", help="MLflow UI to link runs to (default: "
        "MLFLOW_TRACKING_URI when it is a server, else the one `asyncrl up` started)."),
    prefect_api: str | None = typer.Option(
        None, "--prefect-api", metavar="URL", help="Prefect API to link flow runs to (default: "
        "PREFECT_API_URL, else the server `asyncrl up` started)."),
) -> None:
    """Serve the campaign dashboard: campaigns, each campaign's ladder (live while it runs),
    every candidate's gates, diagnostics charts, diagnosis, recipe diff and rollouts, and the
    registry. It only reads; Ctrl-C stops it."""
    import socket

    if not 0 < port < 65536:
        fail(f"port {port} is not a valid port; choose another with --port")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            fail(f"cannot serve on {host}:{port} ({e.strerror}); choose another with --port "
                 "or stop what uses it")
    import uvicorn

    from ui.dashboard.app import DashboardConfig, allowed_hosts_for, create_app

    app = create_app(DashboardConfig(registry_url=registry_url, mlflow_url=mlflow_url,
                                     prefect_api=prefect_api,
                                     allowed_hosts=allowed_hosts_for(host)))
    typer.echo(f"asyncrl dashboard on http://{host}:{port} (Ctrl-C stops it)")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)
