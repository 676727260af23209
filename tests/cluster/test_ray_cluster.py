"""asyncrl on a real multi-node Ray cluster on this machine (platform/local-cluster.sh: `ray start
--head` and two worker nodes, each its own raylet, every server on 127.0.0.1), as
platform/README.md's walk-through drives it: runs started with `asyncrl train --ray-address`, the
placement they get (read back through Ray's state API), and a worker node lost mid-run.

The cluster: head (1 CPU, the driver's node), worker 1 (2 CPUs, ``train_node: 1``,
``rollout_node: 1``), worker 2 (2 CPUs, ``rollout_node: 1``). A recipe that asks for
``trainer: {train_node: 1}`` and two engines of ``rollout: {rollout_node: 1}`` can only be placed
one way: the trainer and one engine on worker 1, the other engine on worker 2.

Every test runs the CLI in a subprocess (its own Ray driver, as a user's shell would), so this
pytest process never joins the cluster. The cluster is the session's (tests/cluster/conftest.py,
shared with test_campaign_on_cluster.py, which runs first); the last two tests here take its
worker nodes away one after the other.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from cluster_helpers import alive, listening_addresses, process_tree

pytestmark = pytest.mark.slow  # a 3-node cluster and four runs (≈4 min on 2 cores)

STEPS = 3
RECIPE = {
    "name": "cluster",
    "steps": STEPS,
    "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32, "num_layers": 2},
    "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 16},
    "engines": {"num_rollout_engines": 2,
                "placement": {"trainer": {"train_node": 1}, "rollout": {"rollout_node": 1},
                              "timeout_s": 120}},
    "async": {"mode": "one_step"},
    "eval": {"every": 0, "n": 0},
}
B = 4 * 4  # samples per step


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip() and "step/eval_only" not in line]


def test_the_cluster_listens_on_loopback_only(cluster):
    nodes = cluster.nodes()
    assert len(nodes) == 3
    # every listening socket of the cluster's processes is on 127.0.0.1
    pids = {p for top in cluster.pids for p in process_tree(top)}
    listening = listening_addresses()
    bad = []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                address = listening[target[8:-1]]
                if not address.startswith(("127.0.0.1:", "::1:")):
                    bad.append((pid, address))
    assert pids and not bad


def test_a_run_places_its_trainer_and_engines_where_its_resources_say(cluster, tmp_path):
    nodes = cluster.nodes()
    train_node = next(n for n, r in nodes.items() if "train_node" in r)
    rollout_only = next(n for n, r in nodes.items() if "rollout_node" in r and n != train_node)
    head = next(n for n, r in nodes.items() if "node:__internal_head__" in r)
    before = {a["id"] for a in cluster.actors()}
    # platform/README.md's command: the placement given with --set
    plain = {**RECIPE, "engines": {"num_rollout_engines": 2}}
    res = cluster.train(tmp_path, plain, tmp_path / "run", extra=(
        "--set", "engines.placement.trainer={train_node: 1}",
        "--set", "engines.placement.rollout={rollout_node: 1}"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert rows[-1]["async/trained_samples"] == STEPS * B
    actors = [a for a in cluster.actors() if a["id"] not in before]  # the run's
    where = {}
    for a in actors:
        where.setdefault(a["cls"], []).append(a["node"])
    assert where["TrainerWorker"] == [train_node]
    assert where["Rollouter"] == [train_node] and where["SampleBuffer"] == [train_node]
    # one engine per rollout_node: worker 1 and worker 2
    assert sorted(where["EmbeddedEngineActor"]) == sorted([train_node, rollout_only])
    assert head not in {n for ns in where.values() for n in ns}  # nothing heavy on the head


def test_a_run_that_does_not_fit_waits_then_says_what_is_missing(cluster, tmp_path):
    recipe = {**RECIPE, "name": "too-big",
              "engines": {**RECIPE["engines"], "num_rollout_engines": 3,
                          "placement": {**RECIPE["engines"]["placement"], "timeout_s": 5}}}
    res = cluster.train(tmp_path, recipe, tmp_path / "run")
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert "no room for this run's bundles" in last and "rollout_node: 2" in last
    assert "Traceback" not in res.stderr


def test_losing_an_engine_node_mid_run_loses_nothing(cluster, tmp_path):
    """kill -9 of worker 2's raylet while the run trains: its engine goes with the node, the
    run goes on with worker 1's engine and trains every step on every sample."""
    recipe = {**RECIPE, "name": "lose-node", "steps": 8}
    run_dir = tmp_path / "run"
    proc = cluster.train(tmp_path, recipe, run_dir, wait=False)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").is_file() and len(_rows(run_dir)) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        node2 = process_tree(cluster.pids[2])  # its raylet, workers, actors, engine server
        assert len(node2) >= 3
        os.kill(cluster.raylet_of(2), signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(8))
    assert rows[-1]["async/trained_samples"] == 8 * B
    assert rows[-1]["async/engine_ejections"] >= 1
    deadline = time.monotonic() + 90  # the GCS marks a node dead after its health checks fail
    while len(cluster.nodes()) != 2 and time.monotonic() < deadline:
        time.sleep(2)
    assert len(cluster.nodes()) == 2
    # nothing of the lost node is left running: its engine's server went with its actor
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in node2 - {cluster.pids[2]}):
        time.sleep(0.5)
    assert not [p for p in node2 - {cluster.pids[2]} if alive(p)]


def test_losing_the_trainers_node_stops_the_run_with_a_clear_error(cluster, tmp_path):
    """After the test above only worker 1 is left (one rollout_node): a one-engine run on it,
    then its raylet killed: the run stops with one line naming the resume, no traceback."""
    recipe = {**RECIPE, "name": "lose-trainer", "steps": 20,
              "engines": {**RECIPE["engines"], "num_rollout_engines": 1}}
    run_dir = tmp_path / "run"
    proc = cluster.train(tmp_path, recipe, run_dir, wait=False)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").is_file() and len(_rows(run_dir)) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        os.kill(cluster.raylet_of(1), signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "died" in last and "Traceback" not in err, err[-3000:]
    assert (run_dir / "checkpoint" / "runtime.json").is_file()  # what a resume starts from
