"""Where a run's processes go: one Ray placement group per run (``engines.placement``).

Bundle 0 holds the trainer (the rollouter and the sample buffer ride in it with no resources of
their own, so they land on the trainer's node); bundles 1…n hold the embedded rollout engines,
one each. SGLang engines keep the GPU placement group of their fleet
(:mod:`training.engines.sglang.fleet`) and the Megatron ranks theirs
(:mod:`training.engines.megatron`); the run's group then holds the trainer's bundle only.

The group is created before anything of the run starts and waits for room: on a cluster whose
free resources hold k runs' bundles, the (k+1)-th run waits until one finishes, which is how a
stage's parallel candidates share a cluster. A run alone waits up to ``timeout_s``, then stops
with :class:`PlacementError` naming what it asked for and what the cluster has; a run beside
other runs of the same process that hold groups waits on while the cluster could hold it once
they end. A run with more groups than its own (SGLang engines, Megatron ranks) places them all
under :func:`placing_alone`, so two such runs never each hold half of what they need. The group
is removed when the run ends, however it ends (Ray also removes it when the driver's job ends).

On a local Ray (:func:`training.ray_setup.init_ray` without an address) the node offers
:data:`training.ray_setup.LOCAL_CPU_SLOTS` logical CPUs per core, so the default recipe (two
1-thread engines and a 1-thread trainer: 3 CPUs) fits on two cores, as it ran before runs had
placement groups (its processes share the cores; ``benchmarks/async_speedup.py`` measures what
that costs).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from training.recipe import Recipe

__all__ = ["PlacementError", "RunPlacement", "placing_alone"]

log = logging.getLogger("asyncrl.runtime")

_HELD = [0]  # placement groups this process's runs hold now (a campaign's parallel runs)
_HELD_LOCK = threading.Lock()
_PLACING = threading.Lock()
"""Held by a run of this process from its own group's reservation until its engines' and ranks'
groups are placed too, when it has such groups (SGLang engines, Megatron ranks): two parallel
runs each holding part of what they need would otherwise wait on each other for good."""


@contextlib.contextmanager
def placing_alone(needed: bool, stop: threading.Event | None = None):
    """:data:`_PLACING` for the duration of the block when ``needed`` (a run with more than one
    placement group); waits in 1 s slices so that ``stop`` interrupts it (KeyboardInterrupt)."""
    if not needed:
        yield
        return
    while not _PLACING.acquire(timeout=1.0):
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
    try:
        yield
    finally:
        _PLACING.release()


class PlacementError(RuntimeError):
    """The cluster never had room for the run's bundles; one line naming what is missing."""


def _clean(bundle: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in bundle.items() if float(v) > 0}


@dataclass
class RunPlacement:
    """The run's placement group and where each of its actors goes.

    Args:
        recipe: the run's recipe (``engines.placement``, thread counts, engine count).
    """

    recipe: Recipe
    group: Any = None
    bundles: list[dict[str, float]] = field(default_factory=list)

    @property
    def embedded_engines(self) -> int:
        e = self.recipe.engines
        return e.num_rollout_engines if e.rollout == "embedded" else 0

    def plan(self) -> list[dict[str, float]]:
        """The bundles: the trainer's, then one per embedded engine."""
        e = self.recipe.engines
        bundles = [_clean(e.trainer_bundle())] + \
            [_clean(e.rollout_bundle()) for _ in range(self.embedded_engines)]
        for i, b in enumerate(bundles):
            if not b:
                what = "trainer" if i == 0 else "rollout"
                raise PlacementError(f"engines.placement.{what} asks for no resources at all; "
                                     "give it at least one (e.g. CPU: 1)")
        return bundles

    def reserve(self, ray: Any, stop: threading.Event | None = None) -> None:
        """Create the group and wait until Ray has placed every bundle.

        The wait is in 1 s slices: ``stop`` set interrupts it (KeyboardInterrupt, as Ctrl-C).
        After ``timeout_s`` the run gives up with :class:`PlacementError` — unless other runs of
        this process (a campaign's parallel runs) hold groups and the cluster could hold this
        one's bundles once they end: then it waits on (they end, or fail, in finite time), and
        its ``timeout_s`` starts again when the last of them has ended."""
        from ray.util.placement_group import placement_group, remove_placement_group

        p = self.recipe.engines.placement
        self.bundles = self.plan()
        self.group = placement_group(self.bundles, strategy=p.strategy)
        ready = self.group.ready()
        start, told, behind = time.monotonic(), False, False
        try:
            while True:
                done, _ = ray.wait([ready], timeout=1.0)
                if done:
                    break
                if stop is not None and stop.is_set():
                    raise KeyboardInterrupt
                if time.monotonic() - start < p.timeout_s:
                    continue
                with _HELD_LOCK:
                    siblings = _HELD[0]
                if siblings and _fits(self.bundles, ray.cluster_resources()):
                    if not told:
                        log.info("waiting for room: %d other runs of this process hold the "
                                 "cluster", siblings)
                        told = True
                    behind = True
                    continue
                if behind:  # the last of them ended: timeout_s again from now
                    behind, start = False, time.monotonic()
                    continue
                raise PlacementError(
                    f"the Ray cluster had no room for this run's bundles {self.bundles} "
                    f"({p.strategy}) within {p.timeout_s:g} s; it has "
                    f"{_short(ray.available_resources())} free of "
                    f"{_short(ray.cluster_resources())}; add nodes with these resources, lower "
                    "engines.num_rollout_engines, or change engines.placement")
        except BaseException:
            remove_placement_group(self.group)
            self.group = None
            raise
        with _HELD_LOCK:
            _HELD[0] += 1

    def strategy(self, bundle: int) -> Any:
        """The scheduling strategy of an actor in ``bundle`` (0 = the trainer's)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=bundle,
                                                placement_group_capture_child_tasks=False)

    def trainer_options(self) -> dict[str, Any]:
        """``ray.remote(...).options`` of the trainer: the whole of bundle 0."""
        b = dict(self.bundles[0])
        cpu = b.pop("CPU", 0.0)
        gpu = b.pop("GPU", 0.0)
        return {"num_cpus": cpu, "num_gpus": gpu, "resources": b or None,
                "scheduling_strategy": self.strategy(0)}

    def companion_options(self) -> dict[str, Any]:
        """The rollouter's and the sample buffer's: on the trainer's node, no resources."""
        return {"num_cpus": 0, "scheduling_strategy": self.strategy(0)}

    def engine_options(self, index: int) -> dict[str, Any]:
        """Embedded engine ``index``'s: the whole of bundle ``index + 1``."""
        b = dict(self.bundles[1 + index])
        cpu = b.pop("CPU", 0.0)
        gpu = b.pop("GPU", 0.0)
        return {"num_cpus": cpu, "num_gpus": gpu, "resources": b or None,
                "scheduling_strategy": self.strategy(1 + index)}

    def release(self, ray: Any) -> None:
        """Remove the group (idempotent; nothing to do once Ray is gone)."""
        if self.group is None:
            return
        group, self.group = self.group, None
        with _HELD_LOCK:
            _HELD[0] -= 1
        if ray is None:
            return
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # the cluster is gone: the group went with it
            remove_placement_group(group)


def _fits(bundles: list[dict[str, float]], total: dict[str, float]) -> bool:
    """Whether the cluster's whole resources could hold every bundle at once (ignoring how they
    split over nodes): a run that can never fit is refused after its timeout."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    return all(total.get(k, 0.0) >= v for k, v in need.items())


def _short(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items()  # not Ray's per-node and per-group entries
            if not k.startswith("node:") and "_group_" not in k
            and k not in ("memory", "object_store_memory")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"
