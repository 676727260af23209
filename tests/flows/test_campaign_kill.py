"""`kill -9` of `asyncrl campaign launch` at five points, each followed by `asyncrl campaign resume
ID`: during the first candidate; after its judgement, before its promotion; during its promotion
(MLflow model version registered, registry row not yet written); during the second stage's
candidate; after the second promotion, before the stage is marked finished. The campaign then
finishes with no lost or duplicated MLflow runs, metric points, model versions, registry rows,
gate results, promotions or trained steps.

Between the kills, two terminals: after the first kill `campaign status` says the campaign
crashed (its owner PID is gone) and names the resume command; the fourth step starts two
`campaign resume ID` at once — exactly one runs, the other is refused in one line naming the
owner, and nothing is duplicated. Prefect's task results stay in the state directory (not in
``~/.prefect``), so a resume hits the cache of the tasks that finished before a kill.

The two kills during training are sent from outside (SIGKILL once the run has logged steps); the
three at exact places between tasks install a hook on the flow's named points
(:data:`flows.campaign.POINT_HOOKS`, through ``crash_at.py``) that SIGKILLs the process there."""

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

pytestmark = pytest.mark.slow  # the campaign killed at five points and resumed (≈4 min)

ROOT = Path(__file__).resolve().parents[2]
CRASH_AT = Path(__file__).with_name("crash_at.py")
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


def _session(sid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                out.append(int(d))
    return out


def _crash_at(point: str, args: list[str], env: dict[str, str], log: Path) -> None:
    """Run the CLI with a kill -9 hook at ``point`` (crash_at.py): it must die by SIGKILL there;
    then stop what it left in its session (by PID). Its stderr goes to ``log``, not a pipe:
    Prefect's temporary API server, left behind by the kill, would hold a pipe open."""
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(CRASH_AT), point, *args], env=env,
                                cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == -signal.SIGKILL, \
        f"expected a crash at {point}, got exit {proc.returncode}: " + log.read_text()[-3000:]
    time.sleep(2.0)
    for p in _session(proc.pid):
        if _alive(p):
            os.kill(p, signal.SIGKILL)


def _launch(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ui.cli", *args], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _status(cid: str, env: dict[str, str]) -> dict:
    res = subprocess.run([sys.executable, "-m", "ui.cli", "campaign", "status", cid, "--json"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_kill_9_at_five_points_then_resume(tmp_path):
    home = tmp_path / "home"
    user_home = tmp_path / "user"  # the user's ~: nothing of Prefect's may land there
    user_home.mkdir()
    env = {**os.environ, "ASYNCRL_HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0",
           "HOME": str(user_home)}
    for var in [k for k in env if k.startswith("PREFECT_")]:
        env.pop(var)
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
    status = _status(cid, env)
    assert status["status"] == "crashed" and status["recorded_status"] == "running"
    assert f"owner PID {proc.pid} on " in status["verdict"]
    assert f"asyncrl campaign resume {cid}" in status["verdict"]

    from mlflow import MlflowClient

    from registry.db import RegistryDB

    def registry() -> RegistryDB:
        return RegistryDB(f"sqlite:///{home / 'registry.db'}")

    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)

    def versions() -> list:
        try:
            return client.search_model_versions("name='asyncrl-killtest'")
        except Exception:  # no registered model yet
            return []

    # 2. after s1's judgement, before its promotion
    _crash_at("judged:s1", ["campaign", "resume", cid], env, tmp_path / "crash1.log")
    db = registry()
    (s1_run,) = db.runs(cid)
    assert {g.name for g in db.gate_results(s1_run.id)} == {"reward_not_collapsed"}
    assert db.promoted(cid, "s1") is None
    db.close()
    assert versions() == []

    # 3. during s1's promotion: the MLflow version exists, the registry row does not
    _crash_at("promote:mlflow:s1", ["campaign", "resume", cid], env,
              tmp_path / "crash2.log")
    assert len(versions()) == 1
    db = registry()
    assert db.promoted(cid, "s1") is None
    db.close()

    # 4. resume; kill again once s1 is promoted and s2 is training
    def s1_promoted_and_s2_running() -> bool:
        if _step_lines(runs / "s2" / "default" / "metrics.jsonl") < 1:
            return False
        db = registry()
        try:
            return db.promoted(cid, "s1") is not None
        finally:
            db.close()

    # two terminals resume at once: one runs, the other is refused in one line naming it
    proc = _launch(["campaign", "resume", cid], env)
    other = _launch(["campaign", "resume", cid], env)
    refused, running = None, None
    deadline = time.monotonic() + 300
    while refused is None:
        assert time.monotonic() < deadline, "neither resume was refused"
        for a, b in ((proc, other), (other, proc)):
            if a.poll() is not None:
                refused, running = a, b
        time.sleep(0.2)
    err = refused.communicate()[1].decode()
    assert refused.returncode == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"error: campaign {cid} is being run by asyncrl PID "
                               f"{running.pid} on "), lines[0]
    time.sleep(1.0)
    for p in _session(refused.pid):  # a temporary Prefect API the refused one started
        if _alive(p):
            os.kill(p, signal.SIGKILL)
    _kill9_when(running, s1_promoted_and_s2_running, "s1 promoted and s2 training")

    # 5. after s2's promotion, before the stage is marked finished
    _crash_at("promoted:s2", ["campaign", "resume", cid], env, tmp_path / "crash3.log")
    db = registry()
    assert db.promoted(cid, "s2") is not None
    assert {s.name: s.status for s in db.stages(cid)}["s2"] == "running"
    db.close()

    # 6. resume to the end
    res = subprocess.run([sys.executable, "-m", "ui.cli", "campaign", "resume", cid, "--json"],
                         env=env, cwd=ROOT, capture_output=True, timeout=600,
                         start_new_session=True)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    out = json.loads(res.stdout)
    assert out["status"] == "finished" and set(out["promoted"]) == {"s1", "s2"}

    db = registry()
    promos = db.promotions(campaign_id=cid)
    assert sorted(p.stage for p in promos) == ["s1", "s2"]  # one each, no duplicate
    assert sorted((r.stage, r.candidate) for r in db.runs(cid)) == [
        ("s1", "default"), ("s2", "default")]
    assert db.get_campaign(cid).status == "finished"
    assert {s.name: s.status for s in db.stages(cid)} == {"s1": "finished",
                                                                "s2": "finished"}
    for run in db.runs(cid):  # one set of gate results per run, not one per judgement
        assert [g.name for g in db.gate_results(run.id)] == ["reward_not_collapsed"]
    assert all(p.mlflow_version for p in promos)
    db.close()
    for stage in ("s1", "s2"):  # every trainer step exactly once in the run's history
        rows = [json.loads(x) for x in (runs / stage / "default" / "metrics.jsonl")
                .read_text().splitlines() if x.strip()]
        assert [r["step"] for r in rows if not r.get("step/eval_only")] == list(range(STEPS))

    exp = client.get_experiment_by_name("asyncrl/killtest")
    all_runs = client.search_runs([exp.experiment_id])
    parents = [r for r in all_runs if r.data.tags.get("asyncrl.kind") == "campaign"]
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 2
    for child in children:
        steps = [m.step for m in client.get_metric_history(child.info.run_id,
                                                           "rollout/reward_mean")]
        assert sorted(steps) == list(range(STEPS)), steps  # each step once
        # the plots drawn after the judge (flows.plot_queue) survived the kills: each run has
        # them, is ended, and no plot is left due
        assert child.info.status == "FINISHED"
        assert any(a.path.endswith(".png")
                   for a in client.list_artifacts(child.info.run_id, "plots"))
    assert not list(runs.glob("*/*/plots.todo.json"))
    # one registered checkpoint per promoted stage, and the registry points at those
    assert sorted(int(v.version) for v in versions()) == [1, 2]
    assert sorted(p.mlflow_version for p in promos) == ["1", "2"]
    champion = client.get_model_version_by_alias("asyncrl-killtest", "champion")
    assert str(champion.version) == "2"
    assert parents[0].info.status == "FINISHED"
    assert "died; resumed by" in parents[0].data.tags["asyncrl.recovered_from_crash"]
    assert _status(cid, env)["status"] == "finished"
    # Prefect ran with asyncrl's settings: its results under the state directory, none in ~
    assert any((home / "prefect" / "storage").iterdir())
    assert not (user_home / ".prefect").exists()
