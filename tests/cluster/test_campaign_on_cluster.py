"""A 2-stage campaign on the session's 3-node cluster (conftest.py), as platform/README.md's
walk-through schedules it: `asyncrl up` (Prefect and the dashboard on 127.0.0.1), `asyncrl deploy`
serving the campaign with the cluster's RAY_ADDRESS, and `asyncrl campaign launch --deployment`
(the flow run the Prefect UI's Quick run makes). Then the walk-through's in-process alternative,
`asyncrl campaign launch --ray-address`, runs the same campaign at `parallel: 1`.

The campaign: stage ``base`` (one candidate), then stage ``pair`` (two candidates, best_eval),
every run asking for ``worker: 1`` per bundle (a trainer and one engine): two runs fill the two
workers' ``worker: 2`` each, so at ``parallel: 2`` the pair trains at once, on the workers only.

Checked: both launches finish and promote both stages; Ray's state API shows every trainer and
engine of the campaign on a worker node, none on the head; at ``parallel: 2`` the pair's runs
overlap in time and at ``parallel: 1`` they do not. Each stage's wall time is printed (the
closing note's parallel 2 vs 1 figure; one machine's two cores bound what parallel can gain).
"""

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
from cluster_helpers import ROOT

from training.engines.ports import free_port

pytestmark = pytest.mark.slow  # Prefect, a served deployment and two campaigns (≈5 min)

TINY = yaml.safe_load((ROOT / "tests" / "tiny-recipe.yaml").read_text())
TINY["steps"] = 3
TINY["engines"] = {"num_rollout_engines": 1,
                   "placement": {"trainer": {"worker": 1}, "rollout": {"worker": 1}}}


def campaign(name: str, parallel: int) -> dict:
    return {"name": name, "base": TINY, "parallel": parallel, "stages": [
        {"name": "base", "gates": [{"name": "staleness_within_bound"}]},
        {"name": "pair", "promotion": "best_eval",
         "candidates": [{"name": "a"}, {"name": "b", "overrides": {"seed": 7}}],
         "gates": [{"name": "staleness_within_bound"}]}]}


def _cli(args: list[str], env: dict[str, str], timeout: float = 900
         ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ui.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def _window(run_dir: Path) -> tuple[float, float]:
    """When a run ran: its recipe.yaml written at the start, its summary.json at the end."""
    return (run_dir / "recipe.yaml").stat().st_mtime, (run_dir / "summary.json").stat().st_mtime


def _span(*windows: tuple[float, float]) -> float:
    return max(w[1] for w in windows) - min(w[0] for w in windows)


def _placed_on_workers(cluster, before: set[str]) -> None:
    nodes = cluster.nodes()
    head = next(n for n, r in nodes.items() if "node:__internal_head__" in r)
    acts = [a for a in cluster.actors() if a["id"] not in before]
    heavy = [a for a in acts if a["cls"] in ("TrainerWorker", "EmbeddedEngineActor")]
    assert len([a for a in heavy if a["cls"] == "TrainerWorker"]) >= 3  # base + a + b
    assert all(a["node"] != head and a["node"] in nodes for a in heavy), heavy


def test_a_campaign_scheduled_on_the_cluster_runs_its_candidates_in_parallel(cluster, tmp_path):
    env = {**cluster.env, "ASYNCRL_HOME": str(tmp_path / "home")}
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "ASYNCRL_REGISTRY_URL", "PREFECT_HOME",
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH"):
        env.pop(var, None)
    path = tmp_path / "onclu.yaml"
    path.write_text(yaml.safe_dump(campaign("onclu", 2)))
    port, dash = free_port(), free_port()
    up = _cli(["up", "--no-mlflow", "--prefect-port", str(port), "--dashboard-port", str(dash),
               "--timeout", "180"], env)
    assert up.returncode == 0, up.stdout + up.stderr
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    serve = None
    before = {a["id"] for a in cluster.actors()}
    try:
        serve = subprocess.Popen([sys.executable, "-m", "ui.cli", "deploy", str(path)], env=env,
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        deadline = time.monotonic() + 180
        while True:  # until the served deployment is registered
            res = _cli(["campaign", "launch", str(path), "--deployment", "--id", "par-2",
                        "--json"], env)
            if "no deployment" not in res.stderr:
                break
            assert serve.poll() is None, serve.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the deployment was never served"
            time.sleep(2)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        out = json.loads(res.stdout)
        assert out["status"] == "finished" and set(out["promoted"]) == {"base", "pair"}
    finally:
        if serve is not None and serve.poll() is None:
            os.killpg(serve.pid, signal.SIGINT)
            try:
                serve.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait(10)
        down = _cli(["down"], env)
        assert down.returncode == 0, down.stdout + down.stderr
    _placed_on_workers(cluster, before)
    runs = tmp_path / "home" / "campaigns" / "par-2" / "pair"
    (a0, a1), (b0, b1) = _window(runs / "a"), _window(runs / "b")
    assert a0 < b1 and b0 < a1, ((a0, a1), (b0, b1))  # the pair trained at once
    par2 = _span((a0, a1), (b0, b1))

    # the in-process alternative at parallel: 1 — the pair one after the other
    path1 = tmp_path / "onclu1.yaml"
    path1.write_text(yaml.safe_dump(campaign("onclu1", 1)))
    env.pop("PREFECT_API_URL")
    before = {a["id"] for a in cluster.actors()}
    seq = _cli(["campaign", "launch", str(path1), "--id", "par-1", "--json",
                "--ray-address", env["RAY_ADDRESS"]], {k: v for k, v in env.items()
                                                       if k != "RAY_ADDRESS"})
    assert seq.returncode == 0, seq.stdout[-3000:] + seq.stderr[-3000:]
    assert json.loads(seq.stdout)["status"] == "finished"
    _placed_on_workers(cluster, before)
    runs1 = tmp_path / "home" / "campaigns" / "par-1" / "pair"
    (a0, a1), (b0, b1) = _window(runs1 / "a"), _window(runs1 / "b")
    assert a1 < b0 or b1 < a0
    print(f"\nstage 'pair' (2 candidates × 3 steps, first run start to last run end) on the "
          f"3-node test cluster: parallel 2 {par2:.1f} s, parallel 1 "
          f"{_span((a0, a1), (b0, b1)):.1f} s")
