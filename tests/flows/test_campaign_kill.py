"""`kill -9` of `asyncrl campaign launch` — during the first candidate, and again during the second
stage after the first promotion — then `asyncrl campaign resume ID`: the campaign finishes with no
lost or duplicated MLflow runs, metric points, registry rows, promotions or trained steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
CAMPAIGN = {
    "name": "killtest",
    "base": {
        "steps": STEPS,
        "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32,
                  "num_layers": 2},
        "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 16},
        "engines": {"num_rollout_engines": 1},
        "eval": {"every": 0, "n": 8},
    },
    "stages": [
        {"name": "s1", "gates": [{"name": "reward_not_collapsed"}]},
        {"name": "s2", "overrides": {"async": {"mode": "one_step"}},
         "gates": [{"name": "reward_not_collapsed"}]},
    ],
}


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d))
    return kids


def _descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
        return ") Z " not in stat
    except (ProcessLookupError, OSError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _step_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum(1 for x in path.read_text().splitlines() if x.strip() and "eval_only" not in x)


def _kill9_when(proc: subprocess.Popen, ready, what: str, timeout: float = 300) -> None:
    """SIGKILL the campaign process once ``ready()``; then check its engine servers exit by
    themselves, and stop the other processes it had started (by PID: Prefect's temporary API
    server is known to stay behind after a hard kill — FACTS.md)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"campaign exited before {what}: " + \
            proc.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    tree = _descendants(proc.pid)
    engines = [p for p in tree if "training.engines.embedded.server" in _cmdline(p)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in engines) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in engines), "engine servers outlived the killed campaign"
    time.sleep(2.0)  # Ray's reaper stops its processes when the driver is gone
    for p in tree:
        if _alive(p):
            os.kill(p, signal.SIGKILL)


def _launch(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ui.cli", *args], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


@pytest.mark.slow
def test_kill_9_at_two_points_then_resume(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "ASYNCRL_HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("ASYNCRL_REGISTRY_URL", None)
    path = tmp_path / "killtest.yaml"
    path.write_text(yaml.safe_dump(CAMPAIGN))
    cid = "killtest-1"
    runs = home / "campaigns" / cid

    # 1. during the first candidate, after it logged two steps
    proc = _launch(["campaign", "launch", str(path), "--id", cid], env)
    _kill9_when(proc, lambda: _step_lines(runs / "s1" / "default" / "metrics.jsonl") >= 2,
                "two steps of s1")

    # 2. resume; kill again once s1 is promoted and s2 is training
    from registry.db import RegistryDB

    def s1_promoted_and_s2_running() -> bool:
        if _step_lines(runs / "s2" / "default" / "metrics.jsonl") < 1:
            return False
        db = RegistryDB(f"sqlite:///{home / 'registry.db'}")
        try:
            return db.promoted(cid, "s1") is not None
        finally:
            db.close()

    proc = _launch(["campaign", "resume", cid], env)
    _kill9_when(proc, s1_promoted_and_s2_running, "s1 promoted and s2 training")

    # 3. resume to the end
    res = subprocess.run([sys.executable, "-m", "ui.cli", "campaign", "resume", cid, "--json"],
                         env=env, cwd=ROOT, capture_output=True, timeout=600,
                         start_new_session=True)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    out = json.loads(res.stdout)
    assert out["status"] == "finished" and set(out["promoted"]) == {"s1", "s2"}

    db = RegistryDB(f"sqlite:///{home / 'registry.db'}")
    promos = db.promotions(campaign_id=cid)
    assert sorted(p["stage"] for p in promos) == ["s1", "s2"]  # one each, no duplicate
    assert sorted((r["stage"], r["candidate"]) for r in db.runs(cid)) == [
        ("s1", "default"), ("s2", "default")]
    assert db.get_campaign(cid)["status"] == "finished"
    db.close()
    for stage in ("s1", "s2"):  # every trainer step exactly once in the run's history
        rows = [json.loads(x) for x in (runs / stage / "default" / "metrics.jsonl")
                .read_text().splitlines() if x.strip()]
        assert [r["step"] for r in rows if not r.get("step/eval_only")] == list(range(STEPS))

    from mlflow import MlflowClient

    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.get_experiment_by_name("asyncrl/killtest")
    all_runs = client.search_runs([exp.experiment_id])
    parents = [r for r in all_runs if r.data.tags.get("asyncrl.kind") == "campaign"]
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 2
    for child in children:
        steps = [m.step for m in client.get_metric_history(child.info.run_id,
                                                           "rollout/reward_mean")]
        assert sorted(steps) == list(range(STEPS)), steps  # each step once
    versions = client.search_model_versions("name='asyncrl-killtest'")
    assert len(versions) == 2  # one registered checkpoint per promoted stage
