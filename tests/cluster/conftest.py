"""The cluster the tests of this folder share: platform/local-cluster.sh's default (head + two
worker nodes on 127.0.0.1), started once for the session by the walk-through's first command and
stopped, by the PIDs the script recorded, after the last test (which checks none is left).
test_campaign_on_cluster.py runs first; test_ray_cluster.py's last two tests take the worker
nodes away."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # cluster_helpers, the tests' helpers

from cluster_helpers import SCRIPT, Cluster, alive, process_tree


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    """platform/README.md's first commands: start the cluster, read its env file."""
    directory = tmp_path_factory.mktemp("cluster")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHON": sys.executable, "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("RAY_ADDRESS", "ASYNCRL_HOME"):
        env.pop(key, None)
    start = subprocess.run(["bash", str(SCRIPT), "start", str(directory)], env=env,
                           capture_output=True, text=True, timeout=600)
    assert start.returncode == 0, start.stderr[-3000:]
    for line in (directory / "env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    c = Cluster(directory, env)
    assert len(c.pids) == 3
    try:
        yield c
    finally:
        tree = {p for top in c.pids for p in process_tree(top)}  # every process of the cluster
        stop = subprocess.run(["bash", str(SCRIPT), "stop", str(directory)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert stop.returncode == 0, stop.stderr
        deadline = time.monotonic() + 30  # workers exit ~2 s after their raylet
        while time.monotonic() < deadline and any(alive(p) for p in tree):
            time.sleep(0.5)
        assert not [p for p in tree if alive(p)]


