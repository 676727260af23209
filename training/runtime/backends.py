"""The rollout backend of a run: the engine processes the rollouter generates through.

DESIGN.md's "rollout engines" box. The recipe's ``engines.rollout`` picks one, once, in
:func:`rollout_backend`; the runtime then talks to it through the same few methods whichever it
is, so no part of the driver asks which backend it has:

- :class:`EmbeddedBackend` — ``engines.num_rollout_engines`` embedded servers
  (:mod:`training.engines.embedded.server`), subprocesses of this driver on free 127.0.0.1 ports,
  seeded ``recipe.seed + i``, one torch thread each; stopped by PID.
- :class:`SGLangBackend` — SGLang engines on Ray actors, optionally behind sglang-router
  (:class:`~training.engines.sglang.fleet.SGLangFleet`); the actors restart a dead engine, so the
  backend tells the fleet the weights a restarted engine must come back with
  (:meth:`RolloutBackend.weights_are`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.engines.hf_io import read_meta
from training.recipe import Recipe

if TYPE_CHECKING:
    from training.engines.embedded.launch import EmbeddedServer
    from training.engines.sglang.fleet import SGLangFleet

__all__ = ["BackendError", "EmbeddedBackend", "RolloutBackend", "SGLangBackend",
           "rollout_backend"]


class BackendError(RuntimeError):
    """The engines could not start or all died; one line naming where to look."""


class RolloutBackend(ABC):
    """The engines of one run. ``start`` returns the URLs the rollouter generates through."""

    #: URLs the rollouter pauses, resumes and loads weights on when they differ from the
    #: generation URLs (behind sglang-router), else None.
    control_urls: list[str] | None = None

    @abstractmethod
    def start(self, ray: Any, checkpoint: Path) -> list[str]:
        """Start the engines on ``checkpoint`` (an HF directory); raise :class:`BackendError`."""

    @abstractmethod
    def alive(self, ray: Any) -> bool:
        """Whether any engine still serves."""

    @abstractmethod
    def failure(self, ray: Any) -> str:
        """One line for a run whose every engine died (with where the logs are)."""

    @abstractmethod
    def log_dir(self) -> Path:
        """Where the engine logs are."""

    def weights_are(self, ray: Any, path: str | Path, version: int) -> None:  # noqa: B027
        """The engines now serve ``path`` at ``version``: engines that restart themselves come
        back with these weights. Nothing to do for engines that do not restart."""

    @abstractmethod
    def stop(self, ray: Any) -> None:
        """Stop every engine this backend started (idempotent; ``ray`` None once Ray is gone)."""


class EmbeddedBackend(RolloutBackend):
    """Embedded rollout servers as subprocesses of the driver (the laptop default)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.servers: list[EmbeddedServer] = []

    def start(self, ray: Any, checkpoint: Path) -> list[str]:
        from training.engines.embedded.launch import EmbeddedServer, start_all

        e = self.recipe.engines
        servers = [EmbeddedServer(checkpoint, dtype=e.rollout_dtype, logit_noise=e.logit_noise,
                                  seed=self.recipe.seed + i, max_batch=e.max_batch,
                                  threads=e.rollout_threads)
                   for i in range(e.num_rollout_engines)]
        self.servers = servers  # stopped by stop() even when start_all fails half-way
        try:
            start_all(servers, timeout=120)
        except Exception as err:
            tail = servers[0].log_tail(300).strip().splitlines()[-1:] if servers else []
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise BackendError(f"rollout engines did not start ({first}); last log line: "
                               f"{tail[0] if tail else '-'}; logs in {self.log_dir()}") from None
        return [s.url for s in servers]

    def alive(self, ray: Any) -> bool:
        return any(s.alive() for s in self.servers)

    def failure(self, ray: Any) -> str:
        return f"see the engine logs in {self.log_dir()}"

    def log_dir(self) -> Path:
        from training.paths import state_dir

        return self.servers[0].log_path.parent if self.servers else state_dir() / "logs"

    def stop(self, ray: Any) -> None:
        for s in self.servers:
            with contextlib.suppress(Exception):
                s.stop()
        self.servers = []


class SGLangBackend(RolloutBackend):
    """SGLang engines on Ray actors (GPUs by placement group), optionally behind sglang-router."""

    def __init__(self, recipe: Recipe, log_dir: Path) -> None:
        self.recipe = recipe
        self._log_dir = log_dir
        self.fleet: SGLangFleet | None = None

    def start(self, ray: Any, checkpoint: Path) -> list[str]:
        from training.engines.sglang.fleet import FleetError, SGLangFleet

        version = int(read_meta(checkpoint).get("weight_version", 0))
        self.fleet = SGLangFleet(self.recipe, checkpoint, version, log_dir=self._log_dir)
        try:
            urls = self.fleet.start(ray)
        except FleetError as err:
            raise BackendError(str(err).splitlines()[0]) from None
        # behind sglang-router the rollouter generates through it, and pauses, continues and
        # loads weights on the engines directly
        self.control_urls = list(self.fleet.engine_urls) if self.fleet.router_url else None
        return urls

    def alive(self, ray: Any) -> bool:
        return self.fleet is not None and self.fleet.alive(ray)

    def failure(self, ray: Any) -> str:
        return self.fleet.failure(ray) if self.fleet is not None else "the fleet never started"

    def log_dir(self) -> Path:
        return self._log_dir

    def weights_are(self, ray: Any, path: str | Path, version: int) -> None:
        if self.fleet is not None:
            self.fleet.set_weights(ray, str(path), version)

    def stop(self, ray: Any) -> None:
        if self.fleet is not None and ray is not None:  # its actors go with Ray otherwise
            self.fleet.stop(ray)
            self.fleet = None


def rollout_backend(recipe: Recipe, run_dir: Path) -> RolloutBackend:
    """The backend ``engines.rollout`` names (SGLang logs under ``$ASYNCRL_HOME/logs/<run>``)."""
    if recipe.engines.rollout == "sglang":
        from training.paths import state_dir

        return SGLangBackend(recipe, state_dir() / "logs" / run_dir.name)
    return EmbeddedBackend(recipe)
