"""The one place asyncrl starts or joins Ray: :func:`init_ray` (CLI runs, the campaign flow, the
Megatron launcher and the benchmarks all call it).

Without an address (argument or ``$RAY_ADDRESS``) it starts a local Ray that guarantees:

- **Loopback only.** Every listening socket of the session — GCS, raylet and object manager,
  every core worker (the driver, the actors), the dashboard agent and its metrics export port,
  the runtime-env agent, the autoscaler monitor — is on 127.0.0.1; the dashboard is not started.
  Ray 2.60 has no public bind option for this: ``ray.init(_node_ip_address="127.0.0.1")`` is
  rewritten to the primary interface's address (``ray._private.services.resolve_ip_for_localhost``)
  and with that node address its servers listen on every interface (measured: 12 non-loopback
  listeners in 10 processes). Its one switch is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` — Ray's
  own single-machine mode, the default on macOS and Windows — under which the node address is
  the loopback address and every server binds to it (measured: 0 non-loopback). Ray reads it once
  at import into ``ray._private.ray_constants.ENABLE_RAY_CLUSTER``, so it is set in the
  environment (for the processes Ray spawns) and on that constant (for this process, in case
  Ray was imported before), both only while ``ray.init`` runs. The node address Ray chose is
  then checked and anything but loopback is refused with :class:`RayStartError`, so a Ray
  release that drops the switch fails loudly instead of listening on the network.
- **It dies with this process** (the driver), however the driver dies: ``kill -9``, a
  process-group kill, a crash. Ray 2.60 does most of it (measured): the GCS, raylet and monitors
  get SIGKILL from the kernel when the driver dies (``PR_SET_PDEATHSIG``); each worker runs in a
  process group of its own (so a process-group kill of the driver misses it), exits ~2 s after
  its raylet dies and stops its own children. What it leaves: the dashboard and runtime-env
  agents outlive a killed raylet by ~60 s (they report its death to the dead GCS with a 60 s
  timeout, ``ray/_private/process_watcher.py``), and a process a worker started whose parent
  exited (a daemon, a server behind a wrapper script) runs on for good. So a reaper — this
  module run as ``python -P …/ray_setup.py reap``, in a session of its own so that a
  process-group kill of the driver spares it — watches the driver (it is the driver's child:
  ``getppid()`` changes when the driver is gone), records the session's process tree every 2 s,
  and when the driver is gone, or the session ended (``ray.shutdown()``), stops every recorded
  process and every process carrying this session's ``ASYNCRL_RAY_SESSION`` mark in its
  environment (what Ray and its workers spawn inherits it): SIGTERM, then SIGKILL after 2 s, by
  PID, with the start time checked so a reused PID is never hit. Measured: everything gone ~2.3 s
  after a ``kill -9`` of the driver or of its process group (without the reaper: the agents
  after ~61 s, a worker's daemon never). Linux only (it reads ``/proc``); elsewhere Ray's own
  fate-sharing is all there is.

With an address it joins that cluster (``auto`` for the local node's): the cluster's network
exposure and lifetime are the cluster's, and this driver's non-detached actors end with it by
Ray's job semantics. A failure to start or join is :class:`RayStartError`, one line.

Imports at module level are the standard library only: the reaper runs without Ray or torch.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["SESSION_MARK", "RayStartError", "init_ray"]

RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
SESSION_MARK = "ASYNCRL_RAY_SESSION"
POLL_S = 0.2  # how often the reaper checks that the driver and the session are alive
TREE_SCAN_S = 2.0  # how often it records the session's process tree
TERM_GRACE_S = 2.0  # SIGTERM → SIGKILL
LOCAL_CPU_SLOTS = 4
"""Logical CPUs a local Ray offers per core. A run's placement group asks for a CPU per engine
and trainer thread (:mod:`training.runtime.placement`): the default recipe needs 3, and the
embedded engines and the trainer mostly wait on each other, so one machine's cores are shared
rather than counted out (``parallel`` caps how many of a stage's runs share them)."""


class RayStartError(RuntimeError):
    """Ray could not be started or joined; the message is one line naming the fix."""


def init_ray(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Connect this process to Ray, unless it already is.

    Args:
        address: a Ray cluster to join (``auto``, ``HOST:PORT``, ``ray://…``); default
            ``$RAY_ADDRESS``; neither: start a local loopback-only Ray reaped with this process.
        num_cpus: cores of a local Ray (default: all, at least 2), each offered as
            :data:`LOCAL_CPU_SLOTS` logical CPUs; ignored when joining.
    Returns:
        True when this call connected (started or joined) Ray, so the caller calls
        ``ray.shutdown()`` when done; False when Ray was already initialised here.
    Raises:
        RayStartError: Ray could not be started or joined, or a local Ray would not be
            loopback-only.
    """
    # before ray is imported: Ray reads its usage-stats setting from the environment
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        _join(ray, address)
    else:
        _start_local(ray, num_cpus or max(2, os.cpu_count() or 2))
    return True


def _join(ray: Any, address: str) -> None:
    _check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError, OSError) as e:
        raise RayStartError(f"cannot join the Ray cluster at {address}: {_first_line(e)}; check "
                            "--ray-address / $RAY_ADDRESS (unset both to start a local Ray)"
                            ) from None


def _check_reachable(address: str) -> None:
    """Refuse a ``HOST:PORT`` nothing answers on: ``ray.init`` would retry it for ~14 minutes
    (20 attempts of ~40 s, ``ray/_private/node.py`` ``_init_gcs_client``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # auto, local, ray://…: Ray answers those itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise RayStartError(f"no Ray cluster answers at {address} ({e.strerror or e}); check "
                            "--ray-address / $RAY_ADDRESS (unset both to start a local Ray)"
                            ) from None


def _start_local(ray: Any, num_cpus: int) -> None:
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    before = _children(os.getpid())
    with _loopback_only(token):
        try:
            context = ray.init(num_cpus=num_cpus * LOCAL_CPU_SLOTS, include_dashboard=False,
                               log_to_driver=False,
                               logging_level=logging.ERROR)
        except (ConnectionError, RuntimeError, ValueError, OSError) as e:
            raise RayStartError(f"cannot start a local Ray: {_first_line(e)}; see the logs in "
                                "/tmp/ray/session_latest/logs, or join a cluster with "
                                "--ray-address") from None
    node = str(context.address_info.get("node_ip_address", ""))
    if not _is_loopback(node):
        ray.shutdown()
        raise RayStartError(f"the local Ray chose the node address {node!r}, not loopback, so it "
                            f"would listen on the network (this Ray ignores {RAY_CLUSTER_SWITCH}"
                            "=0); install ray==2.60.0, or join a cluster on purpose with "
                            "--ray-address")
    roots = sorted(_children(os.getpid()) - before)
    if sys.platform.startswith("linux") and roots:
        try:
            # by file path, -P: the reaper needs no install, and this directory's modules
            # (types.py) must not shadow the standard library's
            subprocess.Popen(
                [sys.executable, "-P", __file__, "reap", str(os.getpid()), token,
                 *map(str, roots)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except OSError as e:
            ray.shutdown()
            raise RayStartError(f"cannot start the reaper of the local Ray ({e}); check that "
                                f"{sys.executable} runs") from None


@contextlib.contextmanager
def _loopback_only(token: str) -> Iterator[None]:
    """Ray's single-machine mode and this session's mark, only while ``ray.init`` runs."""
    saved = {k: os.environ.get(k) for k in (RAY_CLUSTER_SWITCH, SESSION_MARK)}
    os.environ[RAY_CLUSTER_SWITCH] = "0"
    os.environ[SESSION_MARK] = token
    try:  # the switch as this process read it when it imported ray
        from ray._private import ray_constants
    except ImportError:  # another Ray: the node-address check after ray.init still guards
        ray_constants = None
    had = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if had is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if had is not None:
            ray_constants.ENABLE_RAY_CLUSTER = had
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# --- /proc (Linux) ------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent PID, start time in clock ticks, state) of ``pid``; None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields start after the last ')'
    fields = raw[raw.rfind(b")") + 2:].split()
    return int(fields[1]), int(fields[19]), fields[0].decode()


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _children(pid: int) -> set[int]:
    if not sys.platform.startswith("linux"):
        return set()
    return {p for p in _all_pids() if (s := _stat(p)) is not None and s[0] == pid}


def _alive(pid: int, start: int) -> bool:
    s = _stat(pid)
    return s is not None and s[1] == start and s[2] != "Z"


def _descendants(tracked: dict[int, int]) -> dict[int, int]:
    """``tracked`` (PID → start time) with every living descendant of its living members added."""
    kids: dict[int, list[tuple[int, int]]] = {}
    for pid in _all_pids():
        if (s := _stat(pid)) is not None and s[2] != "Z":
            kids.setdefault(s[0], []).append((pid, s[1]))
    out = dict(tracked)
    todo = [pid for pid, start in tracked.items() if _alive(pid, start)]
    while todo:
        for child, start in kids.get(todo.pop(), []):
            if child not in out:
                out[child] = start
                todo.append(child)
    return out


def _marked(token: str) -> dict[int, int]:
    """Processes whose environment carries this session's mark (PID → start time)."""
    mark = f"{SESSION_MARK}={token}".encode()
    out = {}
    for pid in _all_pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if mark in env.split(b"\0") and (s := _stat(pid)) is not None:
            out[pid] = s[1]
    return out


def _sweep(tracked: dict[int, int], token: str, spare: set[int]) -> None:
    """SIGTERM every living recorded or marked process, SIGKILL what is left after the grace."""
    for sig, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 1.0)):
        victims = {pid: start for pid, start in {**_descendants(tracked), **_marked(token)}.items()
                   if pid not in spare and _alive(pid, start)}
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in victims.items()):
            time.sleep(0.05)
        tracked = {**tracked, **victims}


def reap(driver: int, token: str, roots: list[int]) -> None:
    """The reaper's loop (see the module docstring); returns once it has swept the session."""
    tracked = {pid: s[1] for pid in roots if (s := _stat(pid)) is not None}
    root_starts = dict(tracked)
    last_scan = 0.0
    while os.getppid() == driver and any(_alive(p, s) for p, s in root_starts.items()):
        if time.monotonic() - last_scan >= TREE_SCAN_S:
            tracked = _descendants(tracked)
            last_scan = time.monotonic()
        time.sleep(POLL_S)
    _sweep(tracked, token, spare={os.getpid(), driver})


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "reap":
        sys.exit("usage: python -P ray_setup.py reap DRIVER_PID TOKEN ROOT_PID...")
    reap(int(sys.argv[2]), sys.argv[3], [int(p) for p in sys.argv[4:]])
