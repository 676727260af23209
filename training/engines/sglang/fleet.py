"""The SGLang engines of one run, on Ray: placement, start, router, weights, stop.

:class:`SGLangFleet` places ``engines.num_rollout_engines`` :class:`~.actor.SGLangEngineActor` s in
one placement group (a bundle of ``tp_size`` GPUs each, packed onto as few nodes as possible),
starts them in parallel and hands the runtime the URLs its rollouter talks to:

- ``router: asyncrl`` — the engines' own URLs; asyncrl's :class:`~training.engines.client.
  RolloutClient` balances, retries and carries routed experts (R3);
- ``router: sglang-router`` — one ``python -m sglang_router.launch_router`` process on the driver
  in front of them (it drops ``return_routed_experts``, so never with R3; weight loads and pauses
  are sent to the engines directly, never through it).

The actors keep their servers alive (restart + re-sync); the fleet tells them the fleet's weights
after every sync (:meth:`set_weights`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.engines.sglang.launch import router_command
from training.engines.sglang.process import ServerProcess
from training.recipe import Recipe

__all__ = ["FleetError", "SGLangFleet"]


class FleetError(RuntimeError):
    """The fleet could not be placed or started; one line naming the fix (log tails follow)."""


class SGLangFleet:
    """Args:
        recipe: the run's recipe.
        checkpoint: the HF directory the engines start from; ``version`` its weight version.
        log_dir: engine and router logs.
        command: a launch-command template for every engine (tests; see :mod:`.actor`).
        gpus_per_engine: GPUs each actor asks for (default ``tp_size``; 0 for CPU tests).
        placement_timeout_s: how long to wait for the GPUs.
    """

    def __init__(self, recipe: Recipe, checkpoint: str | Path, version: int, *,
                 log_dir: str | Path, command: Sequence[str] | None = None,
                 gpus_per_engine: float | None = None, placement_timeout_s: float = 300.0
                 ) -> None:
        self.recipe = recipe
        self.checkpoint = str(checkpoint)
        self.version = int(version)
        self.log_dir = Path(log_dir)
        self.command = list(command) if command is not None else None
        tp = recipe.engines.sglang.tp_size
        self.gpus_per_engine = float(tp if gpus_per_engine is None else gpus_per_engine)
        self.placement_timeout_s = placement_timeout_s
        self.actors: list[Any] = []
        self.engine_urls: list[str] = []
        self.router: ServerProcess | None = None
        self.router_url: str | None = None
        self._pg: Any = None
        self.host: str | None = "127.0.0.1"

    @property
    def urls(self) -> list[str]:
        """What the rollouter's client is given: the router, or every engine."""
        return [self.router_url] if self.router_url else list(self.engine_urls)

    def start(self, ray: Any) -> list[str]:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from training.engines.sglang.actor import SGLangEngineActor

        e = self.recipe.engines
        n = e.num_rollout_engines
        custom = {k: float(v) for k, v in e.placement.rollout.items()
                  if k not in ("CPU", "GPU") and float(v) > 0}  # engines.placement.rollout
        bundle = {"CPU": 1.0, **({"GPU": self.gpus_per_engine} if self.gpus_per_engine else {}),
                  **custom}
        self._pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ready = self._pg.ready()
        done, _ = ray.wait([ready], timeout=self.placement_timeout_s)
        if not done:
            remove_placement_group(self._pg)
            self._pg = None
            total = ray.cluster_resources().get("GPU", 0)
            raise FleetError(
                f"engines.rollout: sglang needs {n} engines × {self.gpus_per_engine:g} GPUs; the "
                f"Ray cluster has {total:g} GPUs and none freed up in "
                f"{self.placement_timeout_s:.0f} s; lower engines.num_rollout_engines or "
                "engines.sglang.tp_size, or add GPU nodes")
        # one node: servers on 127.0.0.1 only; several: on their node's address, since the
        # rollouter actor may run on any node
        self.host = "127.0.0.1" if len([n for n in ray.nodes() if n.get("Alive")]) == 1 \
            else None
        remote = ray.remote(SGLangEngineActor)
        data = self.recipe.to_dict()
        for i in range(n):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                        placement_group_bundle_index=i)
            self.actors.append(remote.options(
                num_cpus=1, num_gpus=self.gpus_per_engine, resources=custom or None,
                max_concurrency=8, max_restarts=0, scheduling_strategy=strategy).remote(
                data, i, self.checkpoint, self.version, host=self.host,
                command=self.command, log_dir=str(self.log_dir)))
        refs = [a.start.remote() for a in self.actors]
        try:
            self.engine_urls = list(ray.get(refs))
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None) or err
            text = str(cause).strip()
            raise FleetError(f"SGLang engines did not start: {text.splitlines()[0]} "
                             f"(logs in {self.log_dir})\n{text}") from None
        if e.sglang.router == "sglang-router":
            self._start_router(ray)
        return self.urls

    def _start_router(self, ray: Any) -> None:
        from training.engines.ports import free_port

        host = self.host or ray.util.get_node_ip_address()  # where the rollouter can reach it
        port, prom = free_port(host), free_port(host)
        cmd = router_command(self.engine_urls, port=port, prometheus_port=prom, host=host)
        self.router = ServerProcess(cmd, self.log_dir / f"sglang-router-{port}.log")
        self.router.start()
        self.router_url = f"http://{host}:{port}"
        try:
            self.router.wait_http(self.router_url + "/health", 120.0)
        except (RuntimeError, TimeoutError) as err:
            self.router.stop()
            raise FleetError(f"sglang-router did not start: {str(err).splitlines()[0]}") from None

    # --- runtime hooks -----------------------------------------------------------------------
    def statuses(self, ray: Any, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        return list(ray.get([a.status.remote() for a in self.actors], timeout=timeout_s))

    def alive(self, ray: Any) -> bool:
        """Some engine is up or being restarted (and the router, if any, is running)."""
        if self.router is not None and not self.router.alive():
            return False
        try:
            return any(ray.get([a.alive.remote() for a in self.actors], timeout=10.0))
        except Exception:  # an actor process died with its server
            return False

    def failure(self, ray: Any) -> str:
        """Why the fleet is down, for the run's error message."""
        if self.router is not None and not self.router.alive():
            return f"sglang-router exited; log {self.router.log_path}"
        try:
            errors = [s["error"] for s in self.statuses(ray) if s.get("error")]
        except Exception as e:
            return f"the engine actors are gone ({type(e).__name__})"
        return (errors[0].splitlines()[0] if errors else "every SGLang engine stopped") + \
            f"; logs in {self.log_dir}"

    def set_weights(self, ray: Any, path: str, version: int) -> None:
        """The fleet serves ``version`` from ``path`` now (restarted engines load it)."""
        ray.get([a.set_weights.remote(str(path), int(version)) for a in self.actors])

    def push_weights(self, ray: Any, path: str, version: int) -> list[dict[str, Any]]:
        """Load ``path`` on every engine directly (not through a router)."""
        return list(ray.get([a.update_weights_from_disk.remote(str(path), int(version))
                             for a in self.actors]))

    def launches(self, ray: Any) -> int:
        """Server launches so far over the fleet (grows when an engine restarts)."""
        return sum(int(s["launches"]) for s in self.statuses(ray))

    def stop(self, ray: Any) -> None:
        """Router first, then every engine (by PID, via its actor), then the placement group."""
        if self.router is not None:
            self.router.stop()
        if self.actors:
            refs = [a.stop.remote() for a in self.actors]
            deadline = time.monotonic() + 60
            for ref in refs:
                # an actor that died took its server with it (orphan guard)
                with contextlib.suppress(Exception):
                    ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            for a in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(a)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        self.actors, self._pg = [], None
