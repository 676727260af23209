"""Where a run's processes go: one Ray placement group per run (``engines.placement``).

Bundle 0 holds the trainer (the rollouter and the sample buffer ride in it with no resources of
their own, so they land on the trainer's node); bundles 1…n hold the embedded rollout engines,
one each. SGLang engines keep the GPU placement group of their fleet
(:mod:`training.engines.sglang.fleet`) and the Megatron ranks theirs
(:mod:`training.engines.megatron`); the run's group then holds the trainer's bundle only.

The group is created before anything of the run starts and waits for room (``timeout_s``): on a
cluster whose free resources hold k runs' bundles, the (k+1)-th run waits until one finishes,
which is how a stage's parallel candidates share a cluster. A run that waits longer stops with
:class:`PlacementError` naming what it asked for and what the cluster has. The group is removed
when the run ends, however it ends (Ray also removes it when the driver's job ends).

On a local Ray (:func:`training.ray_setup.init_ray` without an address) the node offers
:data:`training.ray_setup.LOCAL_CPU_SLOTS` logical CPUs per core, so the default recipe (two
1-thread engines and a 1-thread trainer: 3 CPUs) fits on two cores, as it ran before runs had
placement groups (its processes share the cores; ``benchmarks/async_speedup.py`` measures what
that costs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from training.recipe import Recipe

__all__ = ["PlacementError", "RunPlacement"]


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

    def reserve(self, ray: Any) -> None:
        """Create the group and wait until Ray has placed every bundle."""
        from ray.util.placement_group import placement_group, remove_placement_group

        p = self.recipe.engines.placement
        self.bundles = self.plan()
        self.group = placement_group(self.bundles, strategy=p.strategy)
        done, _ = ray.wait([self.group.ready()], timeout=p.timeout_s)
        if not done:
            remove_placement_group(self.group)
            self.group = None
            raise PlacementError(
                f"the Ray cluster had no room for this run's bundles {self.bundles} "
                f"({p.strategy}) within {p.timeout_s:g} s; it has "
                f"{_short(ray.available_resources())} free of {_short(ray.cluster_resources())}; "
                "add nodes with these resources, lower engines.num_rollout_engines, or change "
                "engines.placement")

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
        if self.group is None or ray is None:
            return
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # the cluster is gone: the group went with it
            remove_placement_group(self.group)
        self.group = None


def _short(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items()
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"
