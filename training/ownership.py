"""Who owns a run directory or a campaign, and whether that owner is still alive.

Two terminals must never drive the same run directory (or campaign) at once: two writers
interleave ``metrics.jsonl`` and checkpoints and leave a history the gates misread. Ownership
therefore dies with its holder, however it dies:

- a run directory is owned through an OS advisory lock (``fcntl.flock``) on
  ``<run dir>/.owner.lock``; the kernel drops it when the process exits, ``kill -9``
  included, so a crashed owner never blocks a resume. The file also holds the owner's
  :class:`ProcessIdentity` (JSON) so the refusal can name who holds it;
- a campaign is owned through a registry row (``registry.ownership``), because its registry may
  be a PostgreSQL server shared by several machines; its liveness check is
  :meth:`ProcessIdentity.alive` (same host: the PID exists and started at the recorded time, so
  a reused PID is not mistaken for the owner) or, for another host, a heartbeat.

Stdlib only (``fcntl``: POSIX).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["OwnedError", "ProcessIdentity", "RunDirLock", "pid_alive", "process_start_ticks"]

LOCK_FILE = ".owner.lock"


class OwnedError(RuntimeError):
    """Another live process owns the thing; the message names it and what to do (one line)."""


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22); None where
    ``/proc`` is missing or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after its ')'
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
        return state[state.rfind(")") + 2:].split()[0] != "Z"
    except OSError:
        return True


@dataclass(frozen=True)
class ProcessIdentity:
    """One process on one host: ``host``, ``pid``, its start time in ticks (``start_ticks``, None
    where unknown), a random ``token`` telling two owners in one process apart, and
    ``since`` (unix seconds) when it took ownership."""

    host: str
    pid: int
    start_ticks: int | None
    token: str
    since: float

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(host=socket.gethostname(), pid=pid, start_ticks=process_start_ticks(pid),
                   token=uuid.uuid4().hex, since=time.time())

    def alive(self) -> bool | None:
        """True/False for a process on this host; None for another host (cannot be seen from
        here: the caller falls back to a heartbeat)."""
        if self.host != socket.gethostname():
            return None
        if not pid_alive(self.pid):
            return False
        if self.start_ticks is None:
            return True
        now = process_start_ticks(self.pid)
        return now is None or now == self.start_ticks  # a different start: the PID was reused

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"PID {self.pid} on {self.host} (since {when})"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProcessIdentity | None:
        try:
            d = json.loads(text)
            return cls(host=str(d["host"]), pid=int(d["pid"]),
                       start_ticks=None if d.get("start_ticks") is None else int(
                           d["start_ticks"]),
                       token=str(d["token"]), since=float(d["since"]))
        except (ValueError, KeyError, TypeError):
            return None


class RunDirLock:
    """Exclusive ownership of a run directory for as long as this object is held (a context
    manager). Raises :class:`OwnedError` at once when another live process holds it."""

    def __init__(self, run_dir: str | Path, *, what: str = "run directory") -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.what = what
        self.identity = ProcessIdentity.current()
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        import fcntl

        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ProcessIdentity.from_json(_read_fd(fd))
            os.close(fd)
            who = holder.describe() if holder is not None else "another process"
            raise OwnedError(
                f"{self.what} {self.run_dir} is in use by asyncrl {who}; wait for it to "
                "finish or stop that process, then try again") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, self.identity.to_json().encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_fd(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
    return ""
