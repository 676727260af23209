"""One server process (an SGLang engine, sglang-router, or a stand-in in tests), managed by PID.

- started in its **own session** (a terminal's Ctrl-C reaches only the driver, which stops the
  servers in order — the embedded servers' rule) and through :mod:`.orphan_guard`, so it dies with
  the thread that started it even when that process is ``kill -9``-ed;
- stopped by its process group (SIGTERM, then SIGKILL): SGLang's scheduler and detokenizer
  children go with it;
- its output appended to one log file whose tail is quoted when it fails to come up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

__all__ = ["ServerExitedError", "ServerProcess", "ServerStartTimeout"]

_GUARD = Path(__file__).with_name("orphan_guard.py")


class ServerExitedError(RuntimeError):
    """The process exited before it answered; the message holds the log tail."""


class ServerStartTimeout(TimeoutError):
    """The process did not answer in time; the message holds the log tail."""


class ServerProcess:
    """A command run as a server.

    Args:
        command: the program and its arguments.
        log_path: stdout + stderr are appended here (one file across restarts).
        env: the full environment (default: this process's).
        guard_parent: die with this process (:mod:`.orphan_guard`); off for commands that watch
            their parent themselves.
    """

    def __init__(self, command: Sequence[str], log_path: str | Path,
                 env: Mapping[str, str] | None = None, guard_parent: bool = True) -> None:
        self.command = [str(c) for c in command]
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.guard_parent = guard_parent
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> ServerProcess:
        if self.alive():
            raise RuntimeError(f"{self.command[0]} is already running (pid {self.pid})")
        argv = self.command
        if self.guard_parent:
            argv = [sys.executable, str(_GUARD), str(os.getpid()), "--", *argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: "
                      f"{' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        return self

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_http(self, url: str, timeout_s: float, interval_s: float = 0.25) -> None:
        """Block until ``GET url`` answers 200. Raises :class:`ServerExitedError` when the process
        exits first, :class:`ServerStartTimeout` after ``timeout_s``; both quote the log tail."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client() as http:  # one client (and SSL context) for the whole wait
            while True:
                if not self.alive():
                    raise ServerExitedError(
                        f"{self.command[0]} exited (code {self.returncode}) before {url} answered; "
                        f"log {self.log_path}:\n{self.log_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerStartTimeout(
                        f"{url} did not answer 200 within {timeout_s:.0f} s; log {self.log_path}:\n"
                        f"{self.log_tail()}")
                try:
                    # /health_generate runs a generation: allow it time, but not past the deadline
                    if http.get(url, timeout=max(0.5, min(30.0, left))).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))

    def kill(self) -> None:
        """SIGKILL the process itself (a crash, as clients see it)."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL it after ``timeout_s`` (children included)."""
        if self.proc is None or self.proc.poll() is not None:
            return  # exited: its children went with it (they watch their parent)
        pgid = self.proc.pid  # session leader: its pid is the group id
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            self.proc.wait(10)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
