"""The parameter synchroniser: the trainer's new weights onto the rollout engines.

DESIGN.md's "parameter synchroniser" box. One of three transports, chosen once from the recipe
(:attr:`training.recipe.EnginesConfig.weight_transport`) by :func:`parameter_sync`:

- :class:`DiskSync` — the trainer exports an HF directory (``RUN/weights/v<version>``); the
  rollouter pauses generation (partial rollout: in-flight requests keep their tokens), its client
  loads the export on every engine (``/update_weights_from_disk``) and generation resumes.
  Embedded engines, and SGLang behind asyncrl's router.
- :class:`DirectSync` — behind sglang-router: the same export, loaded by each engine's Ray actor
  directly (never through the router, which does not forward weight loads).
- :class:`NcclSync` — no export: the trainer joins one process group with every ready engine and
  broadcasts (``/update_weights_from_distributed``); the group is made again after an engine
  restarted, and a failed broadcast is retried once with the engines that are ready.

Every transport records the versions it synced (the trainer keeps a snapshot of each version
buffered samples may still carry: :meth:`ParameterSync.referenced_versions`) and tells the
backend what its engines now serve, so an engine that restarts comes back with those weights.
A failure is a :class:`SyncError` with one line naming the version and the cause.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.recipe import Recipe
from training.runtime.backends import RolloutBackend, SGLangBackend

if TYPE_CHECKING:
    from training.engines.sglang.nccl_sync import PushReport

__all__ = ["DirectSync", "DiskSync", "NcclSync", "ParameterSync", "SyncError", "SyncReport",
           "first_line", "parameter_sync"]


class SyncError(RuntimeError):
    """A weight sync that failed on every engine; one line."""


@dataclass
class SyncReport:
    """One sync: its metrics (``async/weight_*``), the seconds it took the trainer (export +
    load, counted in ``run/sync_time_s``) and the seconds spent waiting for generation to stop
    (``run/sync_wait_s``)."""

    metrics: dict[str, float] = field(default_factory=dict)
    time_s: float = 0.0
    wait_s: float = 0.0


def first_line(err: BaseException) -> str:
    """The first line of an error (a Ray task error's cause when it has one)."""
    cause = getattr(err, "cause", None) or err
    text = str(cause).strip()
    return text.splitlines()[0] if text else repr(cause)


class ParameterSync(ABC):
    """Args:
        recipe: the run's recipe.
        run_dir: the run directory (exports go to ``run_dir/weights``).
        trainer / rollouter: the run's actor handles.
        backend: the run's rollout engines.
    """

    def __init__(self, recipe: Recipe, run_dir: Path, trainer: Any, rollouter: Any,
                 backend: RolloutBackend) -> None:
        self.recipe = recipe
        self.run_dir = run_dir
        self.trainer = trainer
        self.rollouter = rollouter
        self.backend = backend
        self.synced_versions: list[int] = []
        self.last_synced: int | None = None

    def started_at(self, version: int, synced: list[int] | None = None) -> None:
        """The engines serve ``version`` now (start or resume); ``synced``: the versions a
        resumed run had synced before."""
        if synced is not None:
            self.synced_versions = list(synced)
        if version not in self.synced_versions:
            self.synced_versions.append(version)
        self.last_synced = version

    def sync(self, ray: Any, version: int, next_step: int, consumed_samples: int) -> SyncReport:
        """Put weight ``version`` on the engines; trainer step ``next_step`` trains next and
        ``consumed_samples`` samples have left the buffer (the staleness controller's count)."""
        try:
            report = self._sync(ray, version, next_step, consumed_samples)
        except ray.exceptions.RayTaskError as e:
            raise SyncError(f"weight sync to version {version} failed: {first_line(e)}") from None
        self.last_synced = version
        self.synced_versions.append(version)
        return report

    @abstractmethod
    def _sync(self, ray: Any, version: int, next_step: int, consumed: int) -> SyncReport: ...

    def checkpointed(self, ray: Any, hf_dir: Path, version: int) -> None:  # noqa: B027
        """A checkpoint wrote the served weights to ``hf_dir`` (a transport that leaves nothing
        on disk points restarting engines there)."""

    def referenced_versions(self, step_start_versions: list[int]) -> list[int]:
        """Synced versions that buffered or in-flight samples may still carry (with
        ``max_off_policy_steps`` older ones can only be dropped, so they need no snapshot)."""
        limit = self.recipe.async_.max_off_policy_steps
        if limit is None:
            return list(self.synced_versions)
        oldest = step_start_versions[max(0, len(step_start_versions) - 2 - limit)]
        return [v for v in self.synced_versions if v >= oldest]

    # --- exports (disk and direct) -------------------------------------------------------
    def _export(self, ray: Any, version: int) -> Path:
        target = self.run_dir / "weights" / f"v{version}"
        if version != self.last_synced or not target.is_dir():
            # always a fresh export: a directory left by a run that was interrupted after its
            # last checkpoint holds other weights under the same version number
            ray.get(self.trainer.export.remote(str(target)))
        return target

    def _prune_exports(self, version: int, keep: Path) -> None:
        for old in (self.run_dir / "weights").glob("v*"):  # keep the last two exports
            with contextlib.suppress(ValueError):
                if int(old.name[1:]) < version - 1 and old != keep:
                    shutil.rmtree(old, ignore_errors=True)


class DiskSync(ParameterSync):
    """HF export, loaded on every engine by the rollouter's client (pause → load → resume)."""

    def _sync(self, ray: Any, version: int, next_step: int, consumed: int) -> SyncReport:
        t0 = time.monotonic()
        target = self._export(ray, version)
        export_s = time.monotonic() - t0
        out = dict(ray.get(self.rollouter.sync_weights.remote(str(target), version, next_step,
                                                              consumed)))
        self._prune_exports(version, target)
        self.backend.weights_are(ray, target, version)  # a restarted engine loads these
        out["async/weight_export_s"] = export_s
        return SyncReport(out, export_s + out["async/weight_sync_s"], out["async/sync_wait_s"])


class DirectSync(ParameterSync):
    """Behind sglang-router: drain generation, load the export on every engine through its
    actor (never through the router), resume."""

    def __init__(self, recipe: Recipe, run_dir: Path, trainer: Any, rollouter: Any,
                 backend: SGLangBackend) -> None:
        super().__init__(recipe, run_dir, trainer, rollouter, backend)
        self.fleet_backend = backend

    def _sync(self, ray: Any, version: int, next_step: int, consumed: int) -> SyncReport:
        t0 = time.monotonic()
        target = self._export(ray, version)
        export_s = time.monotonic() - t0
        wait_s = float(ray.get(self.rollouter.begin_weight_sync.remote()))
        t1 = time.monotonic()
        fleet = self.fleet_backend.fleet
        results = fleet.push_weights(ray, str(target), version) if fleet is not None else []
        if not any(r["success"] for r in results):
            why = results[0]["message"] if results else "no engine"
            raise SyncError(f"weight sync to version {version} failed on every engine: {why}")
        load_s = time.monotonic() - t1
        out = dict(ray.get(self.rollouter.end_weight_sync.remote(
            version, next_step, consumed, wait_s, load_s, path=str(target))))
        self._prune_exports(version, target)
        out["async/weight_export_s"] = export_s
        return SyncReport(out, export_s + load_s, wait_s)


class NcclSync(ParameterSync):
    """Broadcast from the trainer: the trainer actor joins one process group with every ready
    engine (again, under a new name, after an engine restarted: the group lost a member), then
    per sync the rollouter stops generation, the trainer broadcasts, generation resumes.

    ``dist_backend``: torch.distributed backend of the group (``gloo`` for CPU tests with
    stand-in engines)."""

    def __init__(self, recipe: Recipe, run_dir: Path, trainer: Any, rollouter: Any,
                 backend: SGLangBackend, dist_backend: str = "nccl") -> None:
        super().__init__(recipe, run_dir, trainer, rollouter, backend)
        self.fleet_backend = backend
        self.dist_backend = dist_backend
        # (fleet launches, engine URLs) when the group was made
        self._group: tuple[int, tuple[str, ...]] | None = None

    def _sync(self, ray: Any, version: int, next_step: int, consumed: int) -> SyncReport:
        self._init_group(ray)
        wait_s = float(ray.get(self.rollouter.begin_weight_sync.remote()))
        t0 = time.monotonic()
        try:
            report: PushReport = ray.get(self.trainer.push_weights_nccl.remote(version))
        except ray.exceptions.RayTaskError:
            # an engine may have died since the group was made, before its actor noticed: give
            # the fleet a moment to see it (a relaunch changes the launch count), remake the
            # group with whoever is ready, and try once more
            fleet = self._fleet()
            launches = fleet.launches(ray)
            settle = time.monotonic() + 10.0
            while fleet.launches(ray) == launches and time.monotonic() < settle and all(
                    st["state"] == "ready" for st in fleet.statuses(ray)):
                time.sleep(0.5)
            self._group = None
            self._init_group(ray)
            try:
                report = ray.get(self.trainer.push_weights_nccl.remote(version))
            except ray.exceptions.RayTaskError as e:
                raise SyncError(f"NCCL weight sync to version {version} failed: "
                                f"{first_line(e)}") from None
        load_s = time.monotonic() - t0
        out = dict(ray.get(self.rollouter.end_weight_sync.remote(
            version, next_step, consumed, wait_s, load_s)))
        out["async/weight_sync_bytes"] = float(report.bytes)
        out["async/weight_broadcast_s"] = float(report.broadcast_seconds)
        return SyncReport(out, load_s, wait_s)

    def checkpointed(self, ray: Any, hf_dir: Path, version: int) -> None:
        # NCCL syncs leave nothing on disk: a restarted engine comes back with the last
        # checkpoint's weights (and reports their version, so its samples count as stale)
        self.backend.weights_are(ray, hf_dir, version)

    def _fleet(self) -> Any:
        if self.fleet_backend.fleet is None:
            raise SyncError("NCCL weight sync: the SGLang engines are not running")
        return self.fleet_backend.fleet

    def _init_group(self, ray: Any) -> None:
        """(Re)make the weight group when the ready engines changed since it was made."""
        fleet = self._fleet()
        sg = self.recipe.engines.sglang
        deadline = time.monotonic() + sg.startup_timeout_s
        while True:  # an engine being relaunched joins once it is ready again
            launches = fleet.launches(ray)
            states = fleet.statuses(ray)
            urls = tuple(st["url"] for st in states if st["state"] == "ready")
            coming = any(st["state"] in ("new", "starting", "restarting") for st in states)
            if urls or not coming or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if (launches, urls) == self._group:
            return
        if not urls:
            raise SyncError(f"NCCL weight sync: no SGLang engine is ready ({fleet.failure(ray)})")
        try:
            # the trainer hosts the rendezvous (rank 0) at its node's address, on a free port
            ray.get(self.trainer.init_weight_sync_nccl.remote(
                list(urls), sg.tp_size, f"asyncrl-weights-{launches}", fleet.host,
                self.dist_backend))
        except ray.exceptions.RayTaskError as e:
            raise SyncError(f"NCCL weight group with the engines failed: {first_line(e)}"
                            ) from None
        self._group = (launches, urls)


def parameter_sync(recipe: Recipe, run_dir: Path, trainer: Any, rollouter: Any,
                   backend: RolloutBackend, *, dist_backend: str = "nccl") -> ParameterSync:
    """The synchroniser of ``recipe.engines.weight_transport``."""
    transport = recipe.engines.weight_transport
    if transport == "disk":
        return DiskSync(recipe, run_dir, trainer, rollouter, backend)
    if not isinstance(backend, SGLangBackend):
        raise SyncError(f"weight transport {transport!r} needs SGLang engines")
    if transport == "direct":
        return DirectSync(recipe, run_dir, trainer, rollouter, backend)
    return NcclSync(recipe, run_dir, trainer, rollouter, backend, dist_backend)

