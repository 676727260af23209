"""One embedded rollout server on a Ray actor: launched and supervised on the node Ray placed the
actor on (the bundle of the run's placement group whose resources it holds), as the SGLang
backend's :class:`~training.engines.sglang.actor.SGLangEngineActor` does for SGLang.

- :meth:`EmbeddedEngineActor.start` launches ``python -m training.engines.embedded.server`` on a
  free port of the node's cluster address (127.0.0.1 when every node of the cluster has that
  address: one machine) and returns its URL once ``/health`` answers.
- The server watches the actor's process (``--parent-pid``): when the actor dies — its node's
  raylet killed, the run's placement group removed, the driver gone — the server exits too.
- A supervisor thread restarts a server that died while the actor lives, on the same port (the
  rollouter's URL stays valid) and from the newest weights the run synced
  (:meth:`set_weights`), at most ``max_restarts`` times; the rollouter's router retries the
  dead server's requests on the others meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["EmbeddedEngineActor"]

log = logging.getLogger("asyncrl.embedded")


class EmbeddedEngineActor:
    """One embedded server, kept alive by this actor.

    Args:
        index: the engine's index in the run (for logs).
        checkpoint: the HF directory it starts from.
        options: :class:`~training.engines.embedded.launch.EmbeddedServer`'s keyword options
            (dtype, logit_noise, seed, max_batch, threads).
        host: the address to listen on; None = this node's cluster address (Ray's view).
        log_dir: where the server log goes (default: ``$ASYNCRL_HOME/logs``).
        max_restarts: restarts of a server that died before the actor gives it up.
    """

    poll_interval_s = 0.5

    def __init__(self, index: int, checkpoint: str, options: dict[str, Any], *,
                 host: str | None = "127.0.0.1", log_dir: str | None = None,
                 max_restarts: int = 3) -> None:
        self.index = index
        self.options = dict(options)
        self.host = host if host is not None else _node_ip()
        self.log_dir = Path(log_dir) if log_dir else None
        self.max_restarts = max_restarts
        self.restarts = 0
        self.error: str | None = None
        self._weights = str(checkpoint)
        self._server: Any = None
        self._port: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _new_server(self) -> Any:
        from training.engines.embedded.launch import EmbeddedServer

        log_path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"engine-{self.index}.log"
        server = EmbeddedServer(self._weights, port=self._port, host=self.host,
                                log_path=log_path, **self.options)
        self._port = server.port
        return server

    def start(self, timeout_s: float = 120.0) -> str:
        """Launch the server and wait until it serves; returns its URL."""
        with self._lock:
            self._server = self._new_server().start()
        self._server.wait_ready(timeout_s)
        self._thread = threading.Thread(target=self._supervise, name=f"embedded-{self.index}",
                                        daemon=True)
        self._thread.start()
        return str(self._server.url)

    def url(self) -> str:
        return str(self._server.url) if self._server is not None else ""

    def set_weights(self, path: str, version: int) -> None:
        """The run now serves ``path`` (weight ``version``): a restart comes back with them."""
        with self._lock:
            self._weights = str(path)

    def alive(self) -> bool:
        return self._server is not None and self._server.alive() and self.error is None

    def where(self) -> dict[str, Any]:
        """The node this engine runs on (Ray's node id), its server's PID and URL."""
        import ray

        server = self._server
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "pid": server.pid if server is not None else None, "url": self.url(),
                "restarts": self.restarts}

    def log_tail(self, chars: int = 300) -> str:
        return self._server.log_tail(chars) if self._server is not None else ""

    def stop(self) -> None:
        """Stop supervising and stop the server (SIGTERM, then SIGKILL), by PID."""
        self._stop.set()
        with self._lock:
            if self._server is not None:
                self._server.stop()

    def _supervise(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            with self._lock:
                server = self._server
            if server is None or server.alive():
                continue
            if self._stop.is_set():
                return
            if self.restarts >= self.max_restarts:
                self.error = (f"engine {self.index} ({server.url}) died {self.restarts + 1} "
                              f"times; log {server.log_path}")
                log.error("%s", self.error)
                return
            self.restarts += 1
            log.warning("engine %d died; restarting it from %s (%d/%d)", self.index,
                        self._weights, self.restarts, self.max_restarts)
            try:
                with self._lock:
                    if self._stop.is_set():  # stop() came in meanwhile: no new server
                        return
                    self._server = self._new_server().start()
                self._server.wait_ready(120.0)
            except Exception as e:  # the next poll sees it dead and counts another restart
                log.warning("engine %d did not come back: %s", self.index,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                time.sleep(1.0)


def _node_ip() -> str:
    """This node's cluster address (Ray's view), 127.0.0.1 outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
