"""MoE routing replay shared by the train engines (R2 / R3 of :mod:`training.engines.train`).

The embedded trainer (:class:`~training.engines.embedded.trainer.EmbeddedTrainEngine`) and each
Megatron rank (:class:`~training.engines.megatron.rank.MegatronRank`) decide the same way which
expert choices a forward replays; only the forward itself differs. This module holds that common
part:

* :class:`RouteCache`: the trainer's own routes per (version, sequence key), FIFO-bounded (R2).
* :func:`pad_routes`: per-sequence routes → one dense ``(b, width, L, k)`` replay tensor.
* :class:`RouteReplay`: a mixin with the checks of rollout routes (R3), the choice of the routes to
  replay for a routing mode, and the recording / caching of the trainer's own routes (R2).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from training.engines.model import ModelConfig
from training.engines.train import (
    ROUTING_MODES,
    SnapshotUnavailableError,
    TokenBatch,
    sequence_key,
)

__all__ = ["RouteCache", "RouteReplay", "pad_routes"]


class RouteCache:
    """The trainer's own MoE routes per (version, sequence key), FIFO-bounded (for R2)."""

    def __init__(self, max_sequences: int) -> None:
        self.max_sequences = int(max_sequences)
        self._d: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()

    def get(self, version: int, key: str) -> torch.Tensor | None:
        return self._d.get((version, key))

    def put(self, version: int, key: str, routes: torch.Tensor) -> None:
        self._d.pop((version, key), None)
        self._d[(version, key)] = routes
        while len(self._d) > self.max_sequences:
            self._d.popitem(last=False)

    def items(self) -> list[tuple[tuple[int, str], torch.Tensor]]:
        return list(self._d.items())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The cache as a safetensors dict: names ``"<FIFO index>:<version>:<key>"`` keep the
        eviction order (read back by sorting the names, then :meth:`replace`)."""
        return {f"{i:09d}:{v}:{k}": r.contiguous() for i, ((v, k), r) in enumerate(self._d.items())}

    def replace(self, items: Sequence[tuple[tuple[int, str], torch.Tensor]]) -> None:
        """Clear the cache, then put ``items`` ((version, key), routes) in order."""
        self._d.clear()
        for (v, k), r in items:
            self.put(v, k, r)

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        self._d.clear()


def pad_routes(batch: TokenBatch, routes: Sequence[torch.Tensor], width: int,
               cfg: ModelConfig) -> torch.Tensor:
    """Per-sequence SGLang-layout routes (P+O−1, L, k) → a ``(b, width, L, k)`` long tensor on
    CPU. Positions without a route (the last token, padding) get experts 0..k−1: they cannot
    influence any log-prob (causal attention)."""
    k = cfg.num_experts_per_tok
    out = torch.arange(k).expand(batch.batch_size, width, cfg.num_layers, k).clone()
    for i, r in enumerate(routes):
        n = int(batch.total_lens[i]) - 1
        out[i, :n] = r[:n].to(torch.long)
    return out


class RouteReplay:
    """R2 / R3 route selection for a train engine (mixed into the embedded trainer and the
    Megatron rank).

    The engine provides ``self._routes`` (a :class:`RouteCache`), :meth:`_route_config` (its model
    config), ``_model_at(version)`` (the model of a version: live or a snapshot, raising
    :class:`SnapshotUnavailableError`) and ``_forward(model, batch, replay, temperature,
    with_entropy)`` returning ``(log_probs, entropy, per-sequence routes)``.
    """

    _routes: RouteCache

    def _route_config(self) -> ModelConfig:
        """The model config whose layers / experts the routes describe."""
        raise NotImplementedError

    def _model_at(self, version: int) -> Any:
        raise NotImplementedError

    def _forward(self, model: Any, batch: TokenBatch, replay: Sequence[torch.Tensor] | None,
                 temperature: float, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        raise NotImplementedError

    def _prepare_route_model(self, model: Any) -> None:
        """Hook run on the model of a past version before R2 records its routes (default:
        nothing)."""

    def _check_rollout_routes(self, batch: TokenBatch) -> list[torch.Tensor]:
        """R3: ``batch.routes`` after checking each sequence's shape (P+O−1, L, k) and expert
        ids; ValueError naming the fix otherwise."""
        cfg = self._route_config()
        if batch.routes is None or any(r is None for r in batch.routes):
            raise ValueError("routing='r3' needs batch.routes for every sequence: the rollout "
                             "engine's routed experts (request return_routed_experts=True)")
        out = []
        for i, r in enumerate(batch.routes):
            assert r is not None
            want = (int(batch.total_lens[i]) - 1, cfg.num_layers, cfg.num_experts_per_tok)
            if tuple(r.shape) != want:
                raise ValueError(f"routes of sequence {i} have shape {tuple(r.shape)}, expected "
                                 f"(P + O − 1, L, k) = {want}; pass the rollout's routed experts "
                                 "from position 0 (routed_experts_start_len=0)")
            if r.numel() and (int(r.min()) < 0 or int(r.max()) >= cfg.num_experts):
                raise ValueError(f"routes of sequence {i} name experts outside "
                                 f"[0, {cfg.num_experts})")
            out.append(r)
        return out

    def _replay_for(self, batch: TokenBatch, routing: str, version: int,
                    r2_version: int | None) -> list[torch.Tensor] | None:
        """Per-sequence routes to replay, or None for the router's own choices at ``version``."""
        if routing not in ROUTING_MODES:
            raise ValueError(f"routing={routing!r}; use one of {', '.join(ROUTING_MODES)}")
        if routing == "free":
            return None
        if not self._route_config().is_moe:
            raise ValueError(f"routing={routing!r} replays MoE expert choices but this model is "
                             "dense; use routing='free'")
        if routing == "r3":
            return self._check_rollout_routes(batch)
        ref = version if r2_version is None else int(r2_version)
        if ref == version:
            return None  # the trainer's own routes at the weights in use = free routing
        return self._own_routes(batch, ref)

    def _own_routes(self, batch: TokenBatch, version: int) -> list[torch.Tensor]:
        """R2: the routes this trainer chooses for ``batch`` under ``version``: cached, or
        recorded (and cached) under the retained snapshot of ``version``."""
        keys = [sequence_key(batch, i) for i in range(batch.batch_size)]
        found: list[torch.Tensor | None] = [self._routes.get(version, k) for k in keys]
        missing = [i for i, r in enumerate(found) if r is None]
        if missing:
            try:
                model = self._model_at(version)
            except SnapshotUnavailableError as e:
                raise SnapshotUnavailableError(
                    f"R2 needs the routes of version {version} for {len(missing)} sequence(s) "
                    f"that were never forwarded under it, and {e}") from None
            sub = batch.select(missing)
            self._prepare_route_model(model)
            with torch.no_grad():
                _, _, routes = self._forward(model, sub, None, 1.0, with_entropy=False)
            assert routes is not None
            for j, i in enumerate(missing):
                found[i] = routes[j]
                self._routes.put(version, keys[i], routes[j])
        return [r for r in found if r is not None]

    def _remember_routes(self, batch: TokenBatch, version: int,
                         routes: Sequence[torch.Tensor]) -> None:
        """Cache the routes a free forward of ``batch`` chose under ``version``."""
        for i, r in enumerate(routes):
            self._routes.put(version, sequence_key(batch, i), r)
