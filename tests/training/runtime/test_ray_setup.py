"""A local Ray started by :func:`training.ray_setup.init_ray` listens on loopback only, and
everything a run starts dies with it, however it dies (issue 13, items 6 and 8).

Each test drives a real run in a subprocess — real Ray (GCS, raylet, agents, the TrainerWorker,
Rollouter and SampleBuffer actors), real embedded rollout servers, a tiny model — paused inside
its first step, so the session is complete when it is audited or killed. Processes of the session
are the driver's descendants plus every process whose command line names the Ray session
directory, recorded while the driver lives; only those are ever signalled, by PID.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from training.ray_setup import RayStartError, init_ray

REPO = Path(__file__).resolve().parents[3]
GONE_WITHIN_S = 15.0  # measured ~2.3 s (SIGTERM, 2 s grace, SIGKILL); room for a busy machine

# The driver: a short real run whose progress callback, after step 1, prints the session and
# waits on stdin while the test looks at (or kills) it.
DRIVER = r"""
import json, os, sys
import ray
from training.recipe import recipe_from_dict
from training.ray_setup import init_ray
from training.runtime.run import run_recipe

assert init_ray(num_cpus=2)


# an actor that starts a daemon (its launcher exits, it runs on in a session of its own), as
# one launching a server through a wrapper script may: Ray stops only a worker's own children
@ray.remote(num_cpus=0)
class Launcher:
    def start(self):
        import subprocess
        out = subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"],
                             start_new_session=True, capture_output=True, text=True, check=True)
        return int(out.stdout)


launcher = Launcher.remote()
detached = ray.get(launcher.start.remote())


def pause(step, total, metrics):
    if step == 1:
        session = ray._private.worker._global_node.get_session_dir_path()
        print(json.dumps({"session": session, "detached": detached}), flush=True)
        sys.stdin.readline()


run_recipe(recipe_from_dict(json.loads(sys.argv[1])), out=sys.argv[2], progress=pause,
           checkpoint_every=0)
print(json.dumps({"finished": True}), flush=True)
"""

RECIPE = {
    "name": "ray-setup", "steps": 3,
    "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32, "num_layers": 2},
    "rollout": {"n": 4, "batch_prompts": 2, "max_response_tokens": 16},
    "engines": {"num_rollout_engines": 1},
    "async": {"mode": "sync"},
    "eval": {"every": 0, "n": 0},
}


@dataclass
class PausedRun:
    driver: subprocess.Popen
    session: str
    procs: dict[int, psutil.Process]  # the session's processes, recorded while the driver lives


def session_processes(driver_pid: int, session: str) -> dict[int, psutil.Process]:
    driver = psutil.Process(driver_pid)
    procs = {driver_pid: driver, **{p.pid: p for p in driver.children(recursive=True)}}
    for p in psutil.process_iter(["cmdline"]):
        if session in " ".join(p.info["cmdline"] or []):
            procs[p.pid] = p
    return procs


def alive(procs: dict[int, psutil.Process]) -> list[psutil.Process]:
    """Those still running (psutil compares the start time, so a reused PID is not them)."""
    out = []
    for p in procs.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:80]}"
    except psutil.Error:
        return str(p.pid)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """One state directory for the module: the second run reuses the first's warm start."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture
def paused_run(home, tmp_path) -> Iterator[PausedRun]:
    env = {**os.environ, "ASYNCRL_HOME": str(home), "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    # its own session, so a process-group kill of it spares pytest
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(RECIPE), str(tmp_path / "run")], cwd=REPO,
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    procs: dict[int, psutil.Process] = {}
    try:
        line = driver.stdout.readline()
        assert line, f"the driver exited before step 1: {driver.stderr.read()[-2000:]}"
        started = json.loads(line)
        session = started["session"]
        procs = session_processes(driver.pid, session)
        procs[started["detached"]] = psutil.Process(started["detached"])  # not a descendant
        yield PausedRun(driver, session, procs)
    finally:  # whatever a failed test left: only the processes recorded above, by PID
        for p in alive(procs):
            p.kill()
        if driver.poll() is None:
            driver.kill()
        driver.wait(timeout=30)


def listeners(procs: dict[int, psutil.Process]) -> list[tuple[str, str, int]]:
    out = []
    for p in alive(procs):
        try:
            conns = p.net_connections(kind="inet")
            name = f"{p.name()}: {' '.join(p.cmdline())[:100]}"
        except psutil.NoSuchProcess:
            continue
        out += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is IPv4 loopback
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def wait_gone(procs: dict[int, psutil.Process], session: str) -> float:
    """Seconds until no recorded process and no process naming ``session`` is left."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < GONE_WITHIN_S:
        left = alive(procs) + [p for p in psutil.process_iter(["cmdline"])
                               if session in " ".join(p.info["cmdline"] or [])]
        if not left:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"still running {GONE_WITHIN_S:.0f} s after the driver ended: "
                         f"{[describe(p) for p in left]}")


@pytest.mark.slow
def test_local_run_listens_on_loopback_only(paused_run):
    names = {" ".join(p.cmdline()) for p in alive(paused_run.procs)}
    for actor in ("ray::TrainerWorker", "ray::Rollouter", "ray::SampleBuffer"):
        assert any(n.startswith(actor) for n in names), f"{actor} is not running: {names}"
    found = listeners(paused_run.procs)
    owners = " ".join(name for name, _, _ in found)
    for part in ("gcs_server", "raylet", "ray::TrainerWorker", "ray::DashboardAgent",
                 "training.engines.embedded.server"):
        assert part in owners, f"no listening socket of {part} was seen: {found}"
    exposed = [f for f in found if not is_loopback(f[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"
    paused_run.driver.stdin.write("\n")  # let the run finish: a clean end leaves nothing either
    paused_run.driver.stdin.flush()
    assert json.loads(paused_run.driver.stdout.readline()) == {"finished": True}
    assert paused_run.driver.wait(timeout=60) == 0
    wait_gone(paused_run.procs, paused_run.session)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill -9 of the driver", "kill -9 of its process group"])
def test_everything_the_run_started_dies_with_it(paused_run, how):
    procs = paused_run.procs
    # the kill has something to prove: Ray's workers run in process groups of their own (out of
    # reach of a process-group kill), the actor's daemon in a session of its own
    driver_group = os.getpgid(paused_run.driver.pid)
    assert any(os.getpgid(p.pid) != driver_group for p in alive(procs)), "no worker group"
    assert len(alive(procs)) >= 8, [describe(p) for p in alive(procs)]
    if how == "kill -9 of the driver":
        paused_run.driver.send_signal(signal.SIGKILL)
    else:
        os.killpg(driver_group, signal.SIGKILL)
    paused_run.driver.wait(timeout=10)
    took = wait_gone(procs, paused_run.session)
    print(f"{how}: {len(procs)} processes gone {took:.1f} s later")


def test_a_cluster_nobody_answers_is_a_one_line_error():
    t0 = time.monotonic()
    with pytest.raises(RayStartError) as err:
        init_ray("127.0.0.1:1")
    assert time.monotonic() - t0 < 10  # ray.init itself would retry for ~14 minutes
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("no Ray cluster answers at 127.0.0.1:1")
