"""The Megatron train engine: :class:`~training.engines.train.TrainEngine` over megatron-core ranks.

:class:`MegatronTrainEngine` is a driver-side facade. It starts one :class:`~training.engines.
megatron.rank.MegatronRank` per rank (world = TP × PP × DP) and implements every protocol method by
calling the same method on all ranks and returning rank 0's answer. Two launchers:

* ``ray`` (default; what ``engines.train: megatron`` runs): one Ray actor per rank, placed with a
  placement group (``placement_strategy``; bundles ask for ``gpus_per_rank`` GPUs only where the
  Ray cluster has GPUs, else one CPU each). Rank 0 names a TCP rendezvous; every rank joins
  torch.distributed (nccl on GPUs, gloo on CPUs) and builds megatron's parallel groups. The driver
  process never imports megatron.
* ``local``: world size 1 in the calling process (tests, debugging; no Ray).

Ranks raise :class:`~training.engines.hf_io.CheckpointError`, ``ValueError`` and
:class:`~training.engines.train.SnapshotUnavailableError` exactly as the embedded engine does;
the facade re-raises the rank's exception itself (not Ray's wrapper), so callers catch the same
types for every backend. See :mod:`training.engines.megatron.rank` for the numerics and the
checkpoint format, :mod:`training.engines.megatron.convert` for the weight layout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from training.engines.model import ModelConfig
from training.engines.train import (
    DEFAULT_STEP_CONFIG,
    LogProbResult,
    OptimConfig,
    StepConfig,
    TokenBatch,
)

if TYPE_CHECKING:
    from training.engines.sglang.nccl_sync import PushReport, WeightGroup

__all__ = [
    "DEFAULT_ROUTE_CACHE_SEQUENCES",
    "DEFAULT_SNAPSHOT_BUDGET_BYTES",
    "LAUNCHERS",
    "PRECISIONS",
    "MegatronSettings",
    "MegatronTrainEngine",
]

DEFAULT_SNAPSHOT_BUDGET_BYTES = 256 * 2**20
DEFAULT_ROUTE_CACHE_SEQUENCES = 50_000
LAUNCHERS = ("ray", "local")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class MegatronSettings:
    """Parallel layout and placement of the ranks (``engines.megatron`` of a recipe)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    data_parallel: int = 1
    gpus_per_rank: float = 1.0
    distributed_optimizer: bool = False
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 120.0
    """Seconds to wait for Ray to place every rank before giving up with the resources needed."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: bf16 weights and activations with fp32 master weights, gradient
    reduction and optimizer state (megatron's mixed-precision optimizer)."""

    def __post_init__(self) -> None:
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy={self.placement_strategy!r}; use one of "
                             f"{', '.join(PLACEMENT_STRATEGIES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"engines.megatron.precision={self.precision!r}; use one of "
                             f"{', '.join(PRECISIONS)}")
        self.parallelism()  # validates the sizes

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    def parallelism(self) -> Any:
        """The ranks' :class:`~training.engines.megatron.rank.Parallelism` (sizes, optimizer,
        precision)."""
        from training.engines.megatron.rank import Parallelism

        return Parallelism(self.tensor_parallel, self.pipeline_parallel, self.expert_parallel,
                           self.data_parallel, self.distributed_optimizer, self.precision)


def _check_fits(directory: str | Path, settings: MegatronSettings) -> None:
    """Refuse a layout that cannot run the model of ``directory`` before any rank starts (a
    directory whose config cannot be read is left to the ranks, which report it)."""
    from training.engines.hf_io import CheckpointError, read_model_config
    from training.engines.megatron.rank import check_model_fits

    try:
        cfg = read_model_config(Path(directory))
    except (CheckpointError, OSError, ValueError):
        return
    check_model_fits(cfg, settings.parallelism())


class _LocalRanks:
    """World size 1 in this process."""

    def __init__(self, settings: MegatronSettings, seed: int) -> None:
        from training.engines.megatron.rank import MegatronRank

        if settings.world_size != 1:
            raise ValueError(f"launcher='local' runs one rank in this process, but "
                             f"TP × PP × DP = {settings.world_size}; use launcher='ray'")
        self.rank = MegatronRank(0, settings.parallelism(), seed)
        self.rank.init_in_process()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.rank, method)(*args, **kwargs)

    def close(self) -> None:
        self.rank.close()


class _RayRanks:
    """One Ray actor per rank inside a placement group."""

    def __init__(self, settings: MegatronSettings, seed: int) -> None:
        from training.ray_setup import init_ray

        init_ray()  # the run's Ray; else a local loopback-only one, or $RAY_ADDRESS's cluster
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from training.engines.megatron.rank import MegatronRank

        self._ray = ray
        n = settings.world_size
        gpus = float(ray.cluster_resources().get("GPU", 0.0))
        use_gpu = gpus > 0 and settings.gpus_per_rank > 0
        bundle = {"CPU": 1.0, **({"GPU": settings.gpus_per_rank} if use_gpu else {})}
        self.pg = placement_group([dict(bundle) for _ in range(n)],
                                  strategy=settings.placement_strategy)
        ready = self.pg.ready()
        done, _ = ray.wait([ready], timeout=settings.placement_timeout_s)
        if not done:
            remove_placement_group(self.pg)
            have = ray.cluster_resources()
            raise RuntimeError(
                f"Ray could not place {n} megatron rank(s) of {bundle} with strategy "
                f"{settings.placement_strategy} within {settings.placement_timeout_s:.0f} s "
                f"(cluster: {have.get('CPU', 0):.0f} CPU, {have.get('GPU', 0):.0f} GPU); lower "
                "engines.megatron tensor/data parallel sizes or add resources")
        actor = ray.remote(MegatronRank)
        self.actors = [
            actor.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i),
            ).remote(i, settings.parallelism(), seed)
            for i in range(n)]
        try:
            host, port = self._get(self.actors[0].master_address.remote())
            self._get([a.init_distributed.remote(host, port) for a in self.actors])
        except BaseException:
            self.close()
            raise

    def _get(self, refs: Any) -> Any:
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])[0]

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for a in getattr(self, "actors", []):
            self._ray.kill(a)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None


class MegatronTrainEngine:
    """Train with megatron-core (see the module docstring). Build with :meth:`from_pretrained`
    (warm start from an HF directory) or :meth:`from_checkpoint` (exact resume)."""

    def __init__(self, ranks: _LocalRanks | _RayRanks, settings: MegatronSettings) -> None:
        self._ranks = ranks
        self.settings = settings
        self._version = 0
        self._step = 0
        self._config: ModelConfig | None = None

    @staticmethod
    def _launch(settings: MegatronSettings | None, launcher: str, seed: int,
                directory: str | Path | None = None
                ) -> tuple[_LocalRanks | _RayRanks, MegatronSettings]:
        settings = settings or MegatronSettings()
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher={launcher!r}; use one of {', '.join(LAUNCHERS)}")
        if directory is not None:
            _check_fits(directory, settings)
        ranks = _LocalRanks(settings, seed) if launcher == "local" else _RayRanks(settings, seed)
        return ranks, settings

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, optim: OptimConfig | None = None,
                        settings: MegatronSettings | None = None, launcher: str = "ray",
                        snapshot_budget_bytes: int = DEFAULT_SNAPSHOT_BUDGET_BYTES,
                        route_cache_sequences: int = DEFAULT_ROUTE_CACHE_SEQUENCES,
                        seed: int = 0) -> MegatronTrainEngine:
        """Warm start from an HF directory (weights, tokenizer, ``weight_version``) with a fresh
        optimizer. Missing / empty / unreadable → :class:`CheckpointError` (no engine)."""
        ranks, settings = cls._launch(settings, launcher, seed, directory)
        engine = cls(ranks, settings)
        try:
            engine._set_state(ranks.call("load_pretrained", str(directory), optim or OptimConfig(),
                                         snapshot_budget_bytes, route_cache_sequences))
        except BaseException:
            ranks.close()
            raise
        return engine

    @classmethod
    def from_checkpoint(cls, directory: str | Path, *, settings: MegatronSettings | None = None,
                        launcher: str = "ray",
                        snapshot_budget_bytes: int = DEFAULT_SNAPSHOT_BUDGET_BYTES,
                        route_cache_sequences: int = DEFAULT_ROUTE_CACHE_SEQUENCES,
                        seed: int = 0) -> MegatronTrainEngine:
        """Exact resume from a :meth:`save_checkpoint` directory (its OptimConfig, step, version,
        RNG, snapshots, R2 routes). Any failure → :class:`CheckpointError`; no engine."""
        ranks, settings = cls._launch(settings, launcher, seed, directory)
        engine = cls(ranks, settings)
        try:
            engine._set_state(ranks.call("load_checkpoint_fresh", str(directory),
                                         snapshot_budget_bytes, route_cache_sequences))
        except BaseException:
            ranks.close()
            raise
        return engine

    def _set_state(self, state: tuple[int, int]) -> None:
        self._version, self._step = int(state[0]), int(state[1])

    # --- state --------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def step(self) -> int:
        return self._step

    @property
    def config(self) -> ModelConfig:
        if self._config is None:
            self._config = self._ranks.call("config")
        return self._config

    @property
    def world_size(self) -> int:
        return self.settings.world_size

    def snapshot_versions(self) -> list[int]:
        return list(self._ranks.call("snapshot_versions"))

    def snapshot_info(self) -> dict[str, Any]:
        """Retained versions, their bytes (rank 0's shard) and the per-rank budget."""
        return dict(self._ranks.call("snapshot_info"))

    def drop_snapshots(self, versions: Sequence[int] | None = None) -> None:
        self._ranks.call("drop_snapshots", None if versions is None else list(versions))

    def close(self) -> None:
        self._ranks.close()

    # --- TrainEngine --------------------------------------------------------------------------
    def compute_log_probs(self, batch: TokenBatch, *, routing: str = "free",
                          version: int | torch.Tensor | None = None, temperature: float = 1.0,
                          with_entropy: bool = True, r2_version: int | None = None,
                          micro_batch_size: int | None = None) -> LogProbResult:
        """See :meth:`training.engines.train.TrainEngine.compute_log_probs`."""
        return self._ranks.call("compute_log_probs", batch, routing=routing, version=version,
                                temperature=temperature, with_entropy=with_entropy,
                                r2_version=r2_version, micro_batch_size=micro_batch_size)

    def ewma_update(self, config: Any, mask_frac: float | None = None) -> tuple[bool, int]:
        """One step of the revised PPO-EWMA reference of ``old_logprob: ewma``, kept on the ranks
        (each averages its own shard: ``MegatronRank.ewma_update``); the first call sets it to the
        current weights. Returns (reset, updates since the last reset)."""
        return self._ranks.call("ewma_update", config, mask_frac)

    def compute_log_probs_ewma(self, batch: TokenBatch, *, routing: str = "free",
                               temperature: float = 1.0, with_entropy: bool = False,
                               r2_version: int | None = None,
                               micro_batch_size: int | None = None) -> LogProbResult:
        """Log-probs of ``batch`` under the EWMA reference (no weight version)."""
        return self._ranks.call("compute_log_probs_ewma", batch, routing=routing,
                                temperature=temperature, with_entropy=with_entropy,
                                r2_version=r2_version, micro_batch_size=micro_batch_size)

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor,
                   old_log_prob: torch.Tensor, *,
                   rollout_is_weights: torch.Tensor | None = None,
                   r2_version: int | None = None,
                   config: StepConfig = DEFAULT_STEP_CONFIG,
                   ref_log_prob: torch.Tensor | None = None,
                   lr_scale: float = 1.0) -> dict[str, float]:
        """See :meth:`training.engines.train.TrainEngine.train_step` (same metrics as the embedded
        engine; ``train/step_time_s`` is measured on rank 0). ``config`` reaches every rank as
        it is (a frozen, picklable dataclass)."""
        t0 = time.perf_counter()
        metrics = self._ranks.call(
            "train_step", batch, advantages, old_log_prob,
            rollout_is_weights=rollout_is_weights, r2_version=r2_version, config=config,
            ref_log_prob=ref_log_prob, lr_scale=lr_scale)
        self._version = int(metrics["train/weight_version"])
        self._step = int(metrics["train/step"])
        metrics["train/call_time_s"] = time.perf_counter() - t0
        return metrics

    def hf_state_dict(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """HF-named, TP-merged fp32 CPU tensors of the current (or a retained) version — what an
        HF directory's model.safetensors holds (no ``lm_head.weight`` when tied); for NCCL weight
        sync."""
        weights = self._ranks.call("hf_state_dict", version)
        assert weights is not None
        return weights

    def init_weight_sync(self, urls: Sequence[str], tp_size: int | Sequence[int],
                         group_name: str, master_address: str | None = None,
                         master_port: int | None = None, backend: str = "nccl"
                         ) -> WeightGroup:
        """(Re)make the broadcast weight group (``engines.sglang.weight_sync: nccl``) with the
        SGLang engines at ``urls``: rank 0 joins it as the group's rank 0 from its own device
        (its GPU for nccl; cpu for gloo), hosting the rendezvous at ``master_address``
        (default: its node's address) and ``master_port`` (default: a free port). Returns the
        group's description (:meth:`~training.engines.sglang.nccl_sync.TrainerNcclPusher.init`).
        """
        info = self._ranks.call("init_weight_sync", list(urls),
                                tp_size if isinstance(tp_size, int) else list(tp_size),
                                group_name, master_address, master_port, backend)
        assert info is not None
        return info

    def push_weights(self, version: int) -> PushReport:
        """Broadcast the current weights to the engines as ``version``: every rank takes part in
        the HF gather, rank 0 broadcasts. Returns the
        :class:`~training.engines.sglang.nccl_sync.PushReport`."""
        report = self._ranks.call("push_weights", int(version))
        assert report is not None
        return report

    def export_weights(self, directory: str | Path, *, version: int | None = None,
                       meta: dict[str, Any] | None = None) -> int:
        """HF directory of the current (or a retained) version, as the embedded engine writes
        it; returns the version recorded in ``asyncrl.json``."""
        return int(self._ranks.call("export_weights", str(directory), version, meta))

    def save_checkpoint(self, directory: str | Path, *, include_snapshots: bool = True) -> Path:
        """Exact-resume checkpoint (an HF directory plus megatron's dist_checkpointing state)."""
        return Path(self._ranks.call("save_checkpoint", str(directory), include_snapshots))

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore a :meth:`save_checkpoint` directory exactly; missing / empty / unreadable /
        another layout → :class:`CheckpointError` with the engine unchanged."""
        self._set_state(self._ranks.call("load_checkpoint", str(directory)))
