"""flows.startup: Prefect's temporary API, MLflow's store and Ray started side by side before a
campaign's flow run, in a fresh process as `asyncrl campaign launch` does, leaving nothing
running when the process ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, urllib.request
from flows.startup import start_services
start_services()
import ray
from prefect.server.api.server import SubprocessASGIServer
server = SubprocessASGIServer()
with urllib.request.urlopen(server.api_url + "/health", timeout=10) as r:
    health = r.status
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:  # the flow's client finds the same server
    api = str(client.api_url)
print(json.dumps({"api": api, "server": server.api_url, "health": health,
                  "ray": ray.is_initialized(), "server_pid": server.server_process.pid}))
"""


def _session(sid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid and ") Z " not in stat:
                out.append(int(d))
    return out


@pytest.mark.slow
def test_starts_all_three_and_leaves_nothing_running(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS",
                        "PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH")}
    env.update(ASYNCRL_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    got = json.loads(out.decode().strip().splitlines()[-1])
    assert got["health"] == 200 and got["ray"] is True
    assert got["api"].rstrip("/") == got["server"].rstrip("/")
    assert got["api"].startswith("http://127.0.0.1:")
    # MLflow's store and Prefect's database were created in the state directory
    assert (tmp_path / "home" / "mlflow" / "mlflow.db").is_file()
    assert (tmp_path / "home" / "prefect" / "prefect.db").is_file()
    deadline = time.monotonic() + 30  # Prefect's server and Ray's processes end with it
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _session(proc.pid) == []


def test_a_chosen_prefect_api_is_used_as_it_is(tmp_path, monkeypatch):
    """PREFECT_API_URL set (the server of `asyncrl up`, say): no temporary server is started;
    MLflow's store is still created."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.startup import start_services

    before = {k: v.running for k, v in SubprocessASGIServer._instances.items()}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        start_services(uri, ray=False)
    after = {k: v.running for k, v in SubprocessASGIServer._instances.items()}
    assert after == before
    assert (tmp_path / "mlflow.db").is_file()


@pytest.mark.parametrize("record", ["{not json", json.dumps({"prefect": {"pid": 1}})])
def test_up_server_not_there(tmp_path, monkeypatch, record):
    from ui.common import up_prefect_api

    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path))
    assert up_prefect_api() is None  # no record
    (tmp_path / "services.json").write_text(record)
    assert up_prefect_api() is None  # unreadable, or pid 1 is not the server it recorded


def test_up_server_found_when_alive_and_answering(tmp_path, monkeypatch):
    """A live process recorded by `asyncrl up` (here: this one, with its start time) whose health
    URL answers 200: its API URL is used; once the URL stops answering, it is not."""
    import http.server
    import threading

    from training.ownership import process_start_ticks
    from ui.common import up_prefect_api

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path))
    (tmp_path / "services.json").write_text(json.dumps({"prefect": {
        "pid": os.getpid(), "pgid": os.getpid(),
        "proc_start": str(process_start_ticks(os.getpid())),
        "health": f"{base}/api/health", "export": f"PREFECT_API_URL={base}/api"}}))
    try:
        assert up_prefect_api() == f"{base}/api"
    finally:
        server.shutdown()
        server.server_close()
    assert up_prefect_api() is None
