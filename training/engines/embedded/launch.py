"""Start and stop embedded rollout servers as subprocesses (tests, benchmarks, local runs).

``EmbeddedServer(checkpoint).start()`` launches ``python -m training.engines.embedded.server`` on a
free 127.0.0.1 port; ``wait_ready()`` polls ``/health``; ``stop()`` sends SIGTERM then SIGKILL;
``kill()`` is the hard crash (SIGKILL) used by failover tests. Output goes to a log file whose
tail is quoted when the server fails to come up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import httpx

from training.engines.ports import free_port
from training.paths import state_dir


class EmbeddedServer:
    """One embedded rollout server process.

    Args:
        checkpoint: HF-format checkpoint directory.
        port: port to bind; a free one when None.
        host: the address to bind (127.0.0.1 unless a cluster node's address is needed).
        dtype / logit_noise / seed / max_batch / threads: server options (``ServerConfig``'s
            fields; an invalid one raises ServerConfigError here, before anything starts).
        entry: the command that serves, before the options (default: this package's server
            module; ``[sys.executable, "-m", "ui.cli", "engine", "serve"]`` runs the CLI).
        log_path: where stdout/stderr go (default: $ASYNCRL_HOME/logs/engine-PORT-TIME.log).
        env: extra environment variables.
        watch_parent: the server exits when this process dies (e.g. ``kill -9`` of a run), so it
            never outlives the run that started it (default server entry only).
    """

    def __init__(self, checkpoint: str | Path, port: int | None = None, *, dtype: str = "bf16",
                 logit_noise: float = 0.0, seed: int = 0, max_batch: int = 64, threads: int = 1,
                 host: str = "127.0.0.1",
                 entry: Sequence[str] | None = None, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, watch_parent: bool = True) -> None:
        from training.engines.embedded.server import ServerConfig  # fastapi: only when serving

        self.config = ServerConfig(checkpoint=str(checkpoint), host=host,
                                   port=port or free_port(host),
                                   dtype=dtype, logit_noise=logit_noise, seed=seed,
                                   max_batch=max_batch, threads=threads)
        # the server exits if this process is killed
        self.parent_pid = os.getpid() if watch_parent and entry is None else None
        self.entry = list(entry or [sys.executable, "-m", "training.engines.embedded.server"])
        if log_path is None:  # logs live in the state directory (DESIGN.md), one per server
            logs = state_dir() / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            log_path = logs / f"engine-{self.port}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        self.log_path = Path(log_path)
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        return self.config.host

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        parent = [] if self.parent_pid is None else ["--parent-pid", str(self.parent_pid)]
        return [*self.entry, *self.config.argv(), *parent]

    def start(self) -> EmbeddedServer:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"server on {self.url} is already running (pid {self.proc.pid})")
        log = open(self.log_path, "ab")  # noqa: SIM115 — the child owns it for its lifetime
        try:
            # own session: a terminal's Ctrl-C reaches only the driver, which stops the server
            # by PID in order (a server dying first would fail an in-flight weight sync)
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(self.env or {})},
                                         start_new_session=True)
        finally:
            log.close()
        return self

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 60.0) -> EmbeddedServer:
        """Block until ``/health`` answers 200; raise with the log tail if the process dies or
        the timeout passes."""
        deadline = time.monotonic() + timeout
        # one client for the whole wait: each ``httpx.get`` builds a client and an SSL context
        # (~80 ms of CPU), which over a start's ~30 polls took CPU from the starting server
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    code = None if self.proc is None else self.proc.returncode
                    raise RuntimeError(f"engine server exited (code {code}) before becoming "
                                       f"healthy:\n{self.log_tail()}")
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"engine server {self.url} not healthy after {timeout:.0f} s:\n"
                           f"{self.log_tail()}")

    def alive(self) -> bool:
        """The process is running."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash, as far as clients can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> EmbeddedServer:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_all(servers: Iterable[EmbeddedServer], timeout: float = 90.0) -> list[EmbeddedServer]:
    """Start several servers at once (they load in parallel) and wait for all; on failure stop
    every one of them before raising."""
    servers = list(servers)
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers
