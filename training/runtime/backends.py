"""The rollout backend of a run: the engine processes the rollouter generates through.

DESIGN.md's "rollout engines" box. The recipe's ``engines.rollout`` picks one, once, in
:func:`rollout_backend`; the runtime then talks to it through the same few methods whichever it
is, so no part of the driver asks which backend it has:

- :class:`EmbeddedBackend` — ``engines.num_rollout_engines`` embedded servers
  (:mod:`training.engines.embedded.server`), each launched and supervised by a Ray actor in its
  bundle of the run's placement group (on the node Ray chose), on a free port of that node's
  address (127.0.0.1 on one machine), seeded ``recipe.seed + i``; stopped by PID by its actor.
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
from training.runtime.placement import RunPlacement

if TYPE_CHECKING:
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
    """Embedded rollout servers, each launched and supervised by an
    :class:`~training.engines.embedded.actor.EmbeddedEngineActor` in its bundle of the run's
    placement group (:mod:`training.runtime.placement`), so on a cluster they run on the nodes
    whose resources ``engines.placement.rollout`` names, not on the driver's machine."""

    def __init__(self, recipe: Recipe, log_dir: Path, placement: RunPlacement) -> None:
        self.recipe = recipe
        self._log_dir = log_dir
        self.placement = placement
        self.actors: list[Any] = []
        self._urls: list[str] = []

    def start(self, ray: Any, checkpoint: Path) -> list[str]:
        from training.engines.embedded.actor import EmbeddedEngineActor

        e = self.recipe.engines
        # one node: servers on 127.0.0.1; several: on their node's address, since the
        # rollouter may run on another node (a one-machine test cluster's nodes are all
        # 127.0.0.1, so they stay on loopback)
        hosts = {n.get("NodeManagerAddress") for n in ray.nodes() if n.get("Alive")}
        host = "127.0.0.1" if hosts <= {"127.0.0.1"} else None
        remote = ray.remote(EmbeddedEngineActor)
        for i in range(e.num_rollout_engines):
            options = {"dtype": e.rollout_dtype, "logit_noise": e.logit_noise,
                       "seed": self.recipe.seed + i, "max_batch": e.max_batch,
                       "threads": e.rollout_threads}
            self.actors.append(remote.options(max_concurrency=4, max_restarts=0,
                                              **self.placement.engine_options(i)).remote(
                i, str(checkpoint), options, host=host, log_dir=str(self._log_dir)))
        try:  # stopped by stop() even when a start fails half-way
            self._urls = list(ray.get([a.start.remote() for a in self.actors]))
        except ray.exceptions.RayError as err:
            cause = getattr(err, "cause", None) or err
            lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
            first = lines[0] if lines else type(cause).__name__
            last = lines[-1] if len(lines) > 1 else "-"
            raise BackendError(f"rollout engines did not start ({first}); last log line: "
                               f"{last}; logs in {self.log_dir()}") from None
        return list(self._urls)

    def alive(self, ray: Any) -> bool:
        if not self.actors:
            return False
        alive = []
        for a in self.actors:
            try:
                alive.append(bool(ray.get(a.alive.remote(), timeout=10.0)))
            except Exception:  # its node (or the actor) is gone
                alive.append(False)
        return any(alive)

    def failure(self, ray: Any) -> str:
        return f"see the engine logs in {self.log_dir()}"

    def log_dir(self) -> Path:
        return self._log_dir

    def weights_are(self, ray: Any, path: str | Path, version: int) -> None:
        for a in self.actors:  # a dead actor's node is gone: the others still need them
            with contextlib.suppress(Exception):
                ray.get(a.set_weights.remote(str(path), int(version)), timeout=10.0)

    def where(self, ray: Any) -> list[dict[str, Any]]:
        """Each engine's node id, server PID and URL (None for an engine whose node died)."""
        out = []
        for a in self.actors:
            try:
                out.append(ray.get(a.where.remote(), timeout=10.0))
            except Exception:
                out.append(None)
        return out

    def stop(self, ray: Any) -> None:
        if ray is not None and self.actors:
            refs = [a.stop.remote() for a in self.actors]  # each actor stops its server by PID
            for ref in refs:  # one dead actor does not cut the others' graceful stop short
                with contextlib.suppress(Exception):
                    ray.get(ref, timeout=15.0)
            for a in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(a)
        if ray is not None or not self.actors:
            self.actors = []
        # ray None: Ray is gone and its actors with it; each server watches its actor and exits


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


def rollout_backend(recipe: Recipe, run_dir: Path, placement: RunPlacement) -> RolloutBackend:
    """The backend ``engines.rollout`` names (engine logs under ``$ASYNCRL_HOME/logs/<run>``);
    embedded engines go in ``placement``'s bundles."""
    from training.paths import state_dir

    logs = state_dir() / "logs" / run_dir.name
    if recipe.engines.rollout == "sglang":
        return SGLangBackend(recipe, logs)
    return EmbeddedBackend(recipe, logs, placement)
