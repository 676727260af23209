"""The Ray actor that owns one SGLang server: start, health, death, restart, weight re-sync.

:class:`SGLangEngineActor` is a plain class (tests drive it directly or as a Ray actor; the
runtime creates it with ``ray.remote(num_gpus=tp_size)`` in a placement group). One supervisor
thread owns the server process for the actor's lifetime:

1. launch ``python -m sglang.launch_server`` (:mod:`.launch`) on a fixed port, with
   ``CUDA_VISIBLE_DEVICES`` = the GPUs Ray gave the actor, in its own session, dying with the
   actor (:mod:`.process`; every launch happens on this thread, which the parent-death signal is
   tied to);
2. wait for ``GET /health_generate`` (a real one-token generation) for ``startup_timeout_s``; a
   server that exits or times out fails with its log tail;
3. bring it to the fleet's weights: the actor remembers the last weights the runtime told it
   about (:meth:`set_weights`: an HF directory and its version); a (re)launched server that
   reports another version in ``/model_info`` is sent ``/update_weights_from_disk`` before it
   counts as ready;
4. watch the process; when it dies, relaunch it on the same port (the router's URL stays valid)
   and repeat 2–3, up to ``max_restarts`` times; then the actor reports ``failed`` with the reason.

The first launch is not retried: a server that cannot start once (bad flags, no GPU memory) will
not start on a second try, and its log says why. A hung server is SGLang's own watchdog's job
(``--watchdog-timeout``, 300 s: it crashes the server, which then restarts here).

``command`` replaces the SGLang command (tests run the embedded server instead, killed with
SIGKILL mid-test): a list whose items may hold ``{host}``, ``{port}``, ``{model_path}`` and
``{weight_version}``, filled at each launch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from training.engines.rollout import ModelInfo, weight_version_label
from training.engines.sglang.launch import ServerSpec, server_command, server_env
from training.engines.sglang.process import ServerExitedError, ServerProcess, ServerStartTimeout
from training.recipe import Recipe

__all__ = ["EngineFailedError", "EngineStartError", "SGLangEngineActor"]

log = logging.getLogger("asyncrl.sglang")


class EngineStartError(RuntimeError):
    """The server did not come up (it exited or timed out); the message holds its log tail."""


class EngineFailedError(RuntimeError):
    """The server died more often than ``max_restarts`` allows; the message says when and why."""


class SGLangEngineActor:
    """One SGLang server, kept alive (see the module docstring).

    Args:
        recipe: ``Recipe.to_dict()`` (engines.sglang: tp_size, startup_timeout_s, max_restarts, …).
        index: the engine's index in the fleet.
        checkpoint: the HF directory the first launch serves.
        weight_version: its asyncrl weight version.
        host: the address to listen on; None = this node's IP (on a multi-node cluster the
            rollouter, wherever Ray placed it, must reach the server).
        port: fixed port (default: a free one, kept across restarts).
        command: the launch command template (default: SGLang's; see the module docstring).
        log_dir: where ``engine-<index>-<port>.log`` goes (default $ASYNCRL_HOME/logs).
        gpu_ids: GPUs to expose (default: ``ray.get_gpu_ids()`` inside a Ray actor, none outside).
        startup_timeout_s / max_restarts: override ``engines.sglang``'s.
        poll_interval_s: how often the process is checked for death.
    """

    def __init__(self, recipe: dict[str, Any], index: int, checkpoint: str, weight_version: int,
                 *, host: str | None = "127.0.0.1", port: int | None = None,
                 command: Sequence[str] | None = None, log_dir: str | None = None,
                 gpu_ids: Sequence[int | str] | None = None,
                 startup_timeout_s: float | None = None, max_restarts: int | None = None,
                 poll_interval_s: float = 0.5) -> None:
        self.recipe = Recipe.model_validate(recipe)
        cfg = self.recipe.engines.sglang
        self.index = int(index)
        self.checkpoint = str(checkpoint)
        self.host = host if host is not None else _node_ip()
        from training.engines.ports import free_port

        self.port = int(port) if port is not None else free_port(self.host)
        self.command = list(command) if command is not None else None
        self.gpu_ids = None if gpu_ids is None else [str(g) for g in gpu_ids]
        self.startup_timeout_s = float(startup_timeout_s if startup_timeout_s is not None
                                       else cfg.startup_timeout_s)
        self.max_restarts = int(max_restarts if max_restarts is not None else cfg.max_restarts)
        self.poll_interval_s = poll_interval_s
        if log_dir is None:
            from training.paths import state_dir

            log_dir = str(state_dir() / "logs")
        self.log_path = Path(log_dir) / f"engine-{self.index}-{self.port}.log"
        # what the fleet serves: the first launch's weights until the runtime says otherwise
        self._weights: tuple[str, int] = (self.checkpoint, int(weight_version))
        self._lock = threading.Lock()
        self._ready = threading.Event()  # the current launch is serving the fleet's weights
        self._settled = threading.Event()  # first start succeeded or failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: ServerProcess | None = None
        self.state = "new"  # new | starting | ready | restarting | failed | stopped
        self.restarts = 0
        self.launches = 0
        self.deaths: list[dict[str, Any]] = []
        self.error: str | None = None

    # --- the runtime's calls -----------------------------------------------------------------
    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}"

    def get_url(self) -> str:
        return self.url

    def start(self, timeout_s: float | None = None) -> str:
        """Launch the server and wait until it serves; returns its URL. Raises
        :class:`EngineStartError` (with the log tail) when it does not come up."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._supervise, name=f"sglang-{self.index}",
                                            daemon=True)
            self._thread.start()
        wait = self.startup_timeout_s + 60.0 if timeout_s is None else timeout_s
        if not self._settled.wait(wait):
            raise EngineStartError(f"engine {self.index} did not settle in {wait:.0f} s")
        if self.state == "failed":
            raise EngineStartError(self.error or f"engine {self.index} failed to start")
        return self.url

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the server serves the fleet's weights (after a restart: once re-synced);
        False on timeout; raises :class:`EngineFailedError` when the actor gave up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.state == "failed":
                raise EngineFailedError(self.error or "engine failed")
            if self._ready.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
                return True
        return self._ready.is_set()

    def set_weights(self, path: str, version: int) -> None:
        """The fleet now serves ``version`` from ``path``: a relaunched server is brought to it."""
        with self._lock:
            self._weights = (str(path), int(version))

    def update_weights_from_disk(self, path: str, version: int) -> dict[str, Any]:
        """Load ``path`` as ``version`` on this server now (and remember it for restarts)."""
        self.set_weights(path, version)
        return self._push_weights(str(path), int(version))

    def alive(self) -> bool:
        """The server is up or being brought back (False once failed or stopped)."""
        return self.state in ("new", "starting", "ready", "restarting")

    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.alive() else None

    def status(self) -> dict[str, Any]:
        with self._lock:
            path, version = self._weights
        return {"index": self.index, "url": self.url, "state": self.state, "pid": self.pid(),
                "launches": self.launches, "restarts": self.restarts,
                "max_restarts": self.max_restarts, "weights_path": path,
                "weight_version": version, "deaths": list(self.deaths), "error": self.error,
                "log_path": str(self.log_path)}

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL, its process group) and the supervisor."""
        self._stop.set()
        proc = self._proc
        if proc is not None:
            proc.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)
        if self.state != "failed":
            self.state = "stopped"

    # --- supervisor thread ---------------------------------------------------------------------
    def _supervise(self) -> None:
        first = True
        while not self._stop.is_set():
            self.state = "starting" if first else "restarting"
            try:
                self._launch()
            except EngineStartError as e:
                if self._stop.is_set():
                    break
                if first or self.restarts >= self.max_restarts:
                    self._fail(str(e) if first else (
                        f"engine {self.index} ({self.url}) could not be restarted after "
                        f"{self.restarts} restarts (max_restarts={self.max_restarts}): {e}"))
                    return
                self.restarts += 1
                log.warning("engine %d: restart failed (%s); trying again (%d/%d)", self.index,
                            str(e).splitlines()[0], self.restarts, self.max_restarts)
                continue
            first = False
            self.state = "ready"
            self._ready.set()
            self._settled.set()
            while not self._stop.wait(self.poll_interval_s):
                if not self._proc.alive():
                    break
            if self._stop.is_set():
                break
            self._ready.clear()
            code = self._proc.returncode
            self.deaths.append({"time": time.time(), "returncode": code, "pid": self._proc.pid})
            if self.restarts >= self.max_restarts:
                self._fail(f"engine {self.index} ({self.url}) died (exit code {code}) "
                           f"{len(self.deaths)} times; max_restarts={self.max_restarts} "
                           f"exhausted; log {self.log_path}:\n{self._proc.log_tail(1500)}")
                return
            self.restarts += 1
            log.warning("engine %d died (exit code %s); restarting it (%d/%d)", self.index, code,
                        self.restarts, self.max_restarts)

    def _fail(self, message: str) -> None:
        self.error = message
        self.state = "failed"
        self._ready.clear()
        self._settled.set()
        log.error("%s", message.splitlines()[0])

    def _launch(self) -> None:
        """Start the process, wait for /health_generate, bring it to the fleet's weights."""
        with self._lock:
            path, version = self._weights
        command = self._command(path, version)
        env = server_env(os.environ, self._gpu_ids(), self.recipe.engines.sglang.tp_size)
        proc = ServerProcess(command, self.log_path, env=env)
        self._proc = proc
        self.launches += 1
        proc.start()
        try:
            proc.wait_http(self.url + "/health_generate", self.startup_timeout_s)
            with self._lock:  # the runtime may have synced while this server was loading
                path, version = self._weights
            served = self._served_version()
            if served != version:
                answer = self._push_weights(path, version)
                if not answer.get("success"):
                    raise EngineStartError(f"re-sync to weight version {version} from {path} "
                                           f"failed: {answer.get('message')}")
        except (ServerExitedError, ServerStartTimeout) as e:
            proc.stop()
            raise EngineStartError(f"engine {self.index} ({self.url}): {e}") from None
        except (httpx.HTTPError, EngineStartError, ValueError) as e:
            proc.stop()
            raise EngineStartError(f"engine {self.index} ({self.url}): {e}") from None

    def _command(self, model_path: str, version: int) -> list[str]:
        if self.command is None:
            spec = ServerSpec(model_path=model_path, port=self.port, host=self.host,
                              weight_version=version, index=self.index)
            return server_command(self.recipe, spec)
        fields = {"host": self.host, "port": self.port, "model_path": model_path,
                  "weight_version": version}
        return [part.format(**fields) for part in self.command]

    def _gpu_ids(self) -> list[str]:
        if self.gpu_ids is not None:
            return self.gpu_ids
        try:
            import ray

            if ray.is_initialized():
                return [str(g) for g in ray.get_gpu_ids()]
        except Exception:  # outside a Ray worker: no assignment
            pass
        return []

    def _served_version(self) -> int:
        resp = httpx.get(self.url + "/model_info", timeout=30.0)
        resp.raise_for_status()
        return ModelInfo.from_dict(resp.json()).weight_version

    def _push_weights(self, path: str, version: int) -> dict[str, Any]:
        resp = httpx.post(self.url + "/update_weights_from_disk",
                          json={"model_path": path,
                                "weight_version": weight_version_label(version)},
                          timeout=max(60.0, self.startup_timeout_s))
        try:
            data = resp.json()
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        return {"success": bool(data.get("success", False) and resp.is_success),
                "message": str(data.get("message", resp.text[:300]))}


def _node_ip() -> str:
    """This node's cluster address (Ray's view), 127.0.0.1 outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
