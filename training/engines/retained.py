"""Trainer state the embedded train engine and the Megatron rank share: retained weight
snapshots and their bookkeeping, RNG state for exact resume, and the pieces of a trainer
checkpoint both write alike (the optimizer config, snapshot and route-cache files).

* :class:`SnapshotStore` — CPU copies of recent weight versions within a byte budget, oldest
  evicted first (seed 003's snapshot-based version tracking).
* :class:`RetainedState` — the snapshot / route-cache / shadow-model bookkeeping mixed into
  :class:`~training.engines.embedded.trainer.EmbeddedTrainEngine` and
  :class:`~training.engines.megatron.rank.MegatronRank`.
* :func:`rng_state` / :func:`set_rng_state` — torch, numpy, python (and CUDA) generators.
* :func:`optim_config_state` / :func:`optim_from_state`, :func:`read_weights`,
  :func:`read_routes` — checkpoint fields; a corrupt one is a one-line
  :class:`~training.engines.hf_io.CheckpointError`.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from training.engines.hf_io import CheckpointError
from training.engines.routes import RouteCache
from training.engines.train import OptimConfig, SnapshotUnavailableError

__all__ = [
    "TRAINER_STATE_FILE",
    "RetainedState",
    "SnapshotStore",
    "Weights",
    "optim_config_state",
    "optim_from_state",
    "read_routes",
    "read_weights",
    "rng_state",
    "set_rng_state",
]

#: The trainer-state file of a checkpoint directory (embedded and Megatron alike).
TRAINER_STATE_FILE = "trainer_state.pt"

Weights = dict[str, torch.Tensor]


def nbytes_of(weights: Weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


class SnapshotStore:
    """CPU copies of recent weight versions within ``budget_bytes``; oldest evicted first.

    ``unit_bytes``: count every snapshot as this many bytes instead of its own size (the Megatron
    ranks pass their largest shard's size, so ranks with smaller shards retain the same
    versions)."""

    def __init__(self, budget_bytes: int, unit_bytes: int | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError("snapshot budget must be >= 0 bytes (0 disables snapshots)")
        self.budget_bytes = int(budget_bytes)
        self.unit_bytes = unit_bytes
        self._snaps: OrderedDict[int, Weights] = OrderedDict()
        self._last_size = 0

    def put(self, version: int, weights: Weights) -> None:
        """Retain ``weights`` (already CPU copies) as ``version``, then evict down to the budget."""
        self._snaps.pop(version, None)
        self._snaps[version] = weights
        self._last_size = self.unit_bytes or nbytes_of(weights)
        while self._snaps and self.nbytes > self.budget_bytes:
            self._snaps.popitem(last=False)

    def get(self, version: int) -> Weights:
        if version not in self._snaps:
            raise SnapshotUnavailableError(self._missing_message(version))
        return self._snaps[version]

    def _missing_message(self, version: int) -> str:
        if self.budget_bytes == 0:
            why = "snapshots are disabled (snapshot_budget_bytes=0)"
        elif not self._last_size:
            why = "no version was retained yet: snapshots are taken right before an update"
        else:
            fit = self.budget_bytes // self._last_size
            why = (f"retained snapshots: {self.versions() or 'none'}; snapshot_budget_bytes="
                   f"{self.budget_bytes} holds {fit} snapshot(s) of {self._last_size} bytes")
        return (f"weight version {version} is not available in this trainer ({why}). Raise "
                "snapshot_budget_bytes, or compute the old log-probs before the update that "
                "replaces that version")

    def versions(self) -> list[int]:
        return list(self._snaps)

    def items(self) -> list[tuple[int, Weights]]:
        return list(self._snaps.items())

    @property
    def nbytes(self) -> int:
        if self.unit_bytes:
            return self.unit_bytes * len(self._snaps)
        return sum(nbytes_of(w) for w in self._snaps.values())

    def drop(self, versions: Sequence[int]) -> None:
        for v in versions:
            self._snaps.pop(v, None)

    def clear(self) -> None:
        self._snaps.clear()

    def replace(self, items: Sequence[tuple[int, Weights]]) -> None:
        """Clear the store, then :meth:`put` ``items`` (version, weights) in order."""
        self.clear()
        for v, w in items:
            self.put(v, w)


class RetainedState:
    """Snapshot and route-cache bookkeeping shared by :class:`EmbeddedTrainEngine` and the
    Megatron rank (:class:`training.engines.megatron.rank.MegatronRank`).

    The engine provides ``_snapshots`` (a :class:`SnapshotStore`), ``_routes`` (a
    :class:`~training.engines.routes.RouteCache`), ``_version`` (the current weight version),
    ``_shadow`` (the model that runs other weights, or None) and ``_shadow_version`` (the
    version loaded into it, or None).
    """

    _snapshots: SnapshotStore
    _routes: RouteCache
    _version: int
    _shadow: Any
    _shadow_version: int | None

    def snapshot_versions(self) -> list[int]:
        return self._snapshots.versions()

    def snapshot_info(self) -> dict[str, Any]:
        """Retained versions, their bytes and the budget."""
        return {"versions": self._snapshots.versions(), "bytes": self._snapshots.nbytes,
                "budget_bytes": self._snapshots.budget_bytes, "current": self._version,
                "route_cache_sequences": len(self._routes)}

    def drop_snapshots(self, versions: Sequence[int] | None = None) -> None:
        """Forget retained versions (all when None)."""
        if versions is None:
            self._snapshots.clear()
        else:
            self._snapshots.drop(versions)
        if self._shadow_version not in self._snapshots.versions():
            self._shadow_version = None

    def close(self) -> None:
        """Release the retained snapshots, the route cache and the shadow model."""
        self._snapshots.clear()
        self._routes.clear()
        self._shadow = None
        self._shadow_version = None

    def _restore_retained(self, snapshots: Sequence[tuple[int, Weights]],
                          routes: Sequence[tuple[tuple[int, str], torch.Tensor]]) -> None:
        """Replace the snapshots and the route cache by a checkpoint's (the shadow model no
        longer holds a known version)."""
        self._snapshots.replace(snapshots)
        self._routes.replace(routes)
        self._shadow_version = None


# ------------------------------------------------------------------------------------------------
# RNG state (exact resume)
# ------------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    _, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(py_version), "state": list(py_state), "gauss_next": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------
# Checkpoint pieces
# ------------------------------------------------------------------------------------------------


def optim_config_state(optim: OptimConfig) -> dict[str, Any]:
    """``optim`` as the ``optim_config`` entry of a trainer state (betas as a list)."""
    return {**asdict(optim), "betas": list(optim.betas)}


def optim_from_state(state: dict[str, Any], d: Path) -> OptimConfig:
    """The OptimConfig of a trainer state read from checkpoint ``d`` (CheckpointError if bad)."""
    try:
        return OptimConfig(**{**state["optim_config"],
                              "betas": tuple(state["optim_config"]["betas"])})
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{d / TRAINER_STATE_FILE}: bad optimizer config ({e}); the "
                              "checkpoint is corrupt — resume from an earlier one") from None


def read_weights(path: Path) -> Weights:
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several types for corrupt files
        raise CheckpointError(f"snapshot {path} is missing or unreadable ({type(e).__name__}: "
                              f"{e}); the checkpoint is incomplete — resume from an earlier "
                              "one") from None


def read_routes(path: Path) -> list[tuple[tuple[int, str], torch.Tensor]]:
    if not path.exists():
        return []
    out = []
    for name, routes in sorted(read_weights(path).items()):
        _, v, key = name.split(":")
        out.append(((int(v), key), routes))
    return out
