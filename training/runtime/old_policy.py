"""π_old and π_prox of a trainer step: the ``algorithm.old_logprob`` strategies (seed 003).

One class per strategy behind :class:`OldPolicy`, chosen once from the recipe by
:func:`old_policy`. The recipe decides which strategy runs
(:attr:`training.recipe.AlgorithmConfig.effective_old_logprob`: a bypass rollout-correction
preset forces bypass); the learner asks the object for a batch's :class:`OldEstimate` and never
compares the strategy's name. Notation: μ the rollout log-probs, π_current the trainer at the
weights the step starts from (version v_θ), v_b the weight version that produced a token, π_v the
trainer at version v.

===========  ====================================================================================
strategy     π_prox (trust-region centre) and π_old (the trainer at the behaviour version)
===========  ====================================================================================
recompute    π_prox = π_old = π_current (staleness and engine mismatch in one ratio); exact on
             the tokens of v_θ
snapshot     π_prox = π_current; π_old = π_{v_b} from the trainer's retained snapshot of v_b, else
             π_current (``old/snapshot_fallback_frac``)
dedicated    π_prox = π_current; π_old = π_{v_b} from a separate frozen copy loaded with every
             synced version (the newest ``dedicated_versions``), else π_current
             (``old/dedicated_fallback_frac``, ``_versions``, ``_bytes``, ``_s``)
interrupt    π_prox = π_current; π_old = ``Sample.old_log_probs`` (the rollouter's π_{v_b} before
             v_b left the engines), else π_current (``old/interrupt_fallback_frac``)
ewma         π_prox = π_old = π_θ̄, θ̄ ← β·θ̄ + (1−β)·θ after each trained step, β = W/(W+2),
             reset to θ by ``reset_interval`` or when ``old/ewma_mask_frac`` > ``reset_mask_frac``
loglinear    π_prox = log μ + α·(log π_current − log μ), α = (v_θ−1−v_b)/(v_θ−v_b) in [0, 1]
             (A-3PO; in trainer steps when the run maps versions to steps); π_old = μ
linear_prox  π_prox = log((1−α)·μ + α·π_current), the same α (AReaL); π_old = μ
bypass       π_prox = π_old = μ
===========  ====================================================================================

The ``decoupled_mis`` correction then sets π_prox := π_old (seed 003 Eq. 4,
:func:`proximal_and_old`).

Why objects: the strategy used to be a string the learner compared in a dozen places (which
forwards to run, which state to keep, which metrics to log, what to do after the update); each
class now holds its own forwards, state and metrics, and the learner's loop is the same for all.

State: every strategy's :meth:`OldPolicy.state_dict` is empty. The EWMA reference and the
dedicated model's copies are parameter tensors; the learner's checkpoint state is JSON
(``learner_state.json``) and a resume rebuilds them from the resumed weights, as it always did.
A strategy with JSON-able state would add it under the learner state's ``old_policy`` key.

Failures: :class:`OldPolicyError` (a ``ValueError``), one line: an unknown strategy, an engine
that cannot run the strategy, a strategy without its reference log-probs.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from training.algorithms.is_correction import (
    EWMAConfig,
    EWMAState,
    applied_weight_metrics,
    compute_is_correction,
    ewma_update,
    linear_proximal_log_prob,
    loglinear_proximal_log_prob,
)
from training.algorithms.masked import masked_mean
from training.engines.train import SnapshotUnavailableError, TokenBatch, TrainEngine
from training.recipe import OldLogprob, Recipe
from training.runtime.types import Sample

__all__ = [
    "STRATEGIES",
    "BypassOld",
    "DedicatedOld",
    "EwmaOld",
    "InterruptOld",
    "LinearProxOld",
    "LoglinearOld",
    "OldEstimate",
    "OldPolicy",
    "OldPolicyError",
    "PackedBatch",
    "RecomputeOld",
    "SnapshotOld",
    "ewma_staleness_window",
    "forward_routing",
    "old_policy",
    "proximal_and_old",
]

log = logging.getLogger("asyncrl.runtime")


class OldPolicyError(ValueError):
    """A strategy that cannot run as asked; one line."""


class PackedBatch(Protocol):
    """What a strategy reads of the learner's packed step (B sequences, T response width)."""

    @property
    def batch(self) -> TokenBatch: ...

    @property
    def samples(self) -> list[Sample]: ...

    @property
    def rollout_log_prob(self) -> torch.Tensor:  # (B, T) μ
        ...

    @property
    def token_versions(self) -> torch.Tensor:  # (B, T) long
        ...


@dataclass
class OldEstimate:
    """What π_prox and π_old are for one batch.

    proximal: (B, T) π_prox, the PPO clip centre (``decoupled_mis`` applied).
    old: (B, T) π_old.
    exact: (B, T) tokens whose π_old is the trainer at their own behaviour version, or None when
        the strategy never gives it (ewma is an average, not a version; loglinear, linear_prox
        and bypass have π_old = μ). ``old/exact_frac`` and ``mismatch/engine/exact`` read it.
    extra: debug tensors (``<strategy>_fallback_mask``, ``loglinear_alpha``).
    metrics: the strategy's ``old/*`` metrics of this batch.
    """

    proximal: torch.Tensor
    old: torch.Tensor
    exact: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Own:
    """A strategy's own policy for a batch, before it is paired into (π_prox, π_old)."""

    reference: torch.Tensor | None = None
    exact: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def forward_routing(recipe: Recipe) -> str:
    """Routing of the no-grad forwards: rollout routes for R3, the router's own otherwise."""
    return "r3" if recipe.routing_replay == "r3" else "free"


def ewma_staleness_window(recipe: Recipe) -> float:
    """Expected staleness W of the revised PPO-EWMA reference, in trainer steps.

    ``algorithm.ewma.staleness_window`` when set; else from the async mode: sync 0, one_step 1,
    fully_async (1 + staleness_threshold) · trigger_parameter_sync_step.
    """
    explicit = recipe.algorithm.ewma.staleness_window
    return float(explicit) if explicit is not None else recipe.async_.ewma_window


def engine_params(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """The engine's parameters, detached on the CPU (engines that expose ``model``)."""
    model = engine.model  # type: ignore[attr-defined]
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _fraction(missing: torch.Tensor, mask: torch.Tensor) -> tuple[int, float]:
    n = int(missing.sum())
    return n, n / max(int(mask.sum()), 1)


# ------------------------------------------------------------------------------------------------
# The interface
# ------------------------------------------------------------------------------------------------


class OldPolicy(ABC):
    """One ``algorithm.old_logprob`` strategy of a run.

    Args:
        recipe: the run's recipe (routing, rollout temperature, correction kind, settings).
        engine: the trainer.
    """

    name: ClassVar[OldLogprob]
    needs_reference: ClassVar[bool] = True
    """The pairing reads the strategy's own (B, T) policy (:func:`proximal_and_old`)."""
    metric_names: ClassVar[tuple[str, ...]] = ()
    """The ``old/*`` metrics the strategy logs besides the ones every strategy has."""

    def __init__(self, recipe: Recipe, engine: TrainEngine) -> None:
        self.recipe = recipe
        self.engine = engine
        self.routing = forward_routing(recipe)
        self.temperature = recipe.rollout.temperature
        self.correction_kind = recipe.algorithm.correction.kind

    @staticmethod
    @abstractmethod
    def pair(current: torch.Tensor, mu: torch.Tensor, reference: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(π_prox, π_old) from π_current, μ and the strategy's own policy (module table)."""

    def _own(self, packed: PackedBatch, current: torch.Tensor, step: int,
             version_to_step: Callable[[int], int] | None) -> _Own:
        """The strategy's own policy of the batch, with its exact tokens, debug tensors and
        metrics (none by default)."""
        return _Own()

    def reference(self, packed: PackedBatch, current: torch.Tensor, *, step: int = 0,
                  version_to_step: Callable[[int], int] | None = None) -> OldEstimate:
        """π_prox and π_old of ``packed`` given its π_current (B, T).

        ``step`` and ``version_to_step`` are the trainer step and the run's map from weight
        versions to trainer steps (loglinear and linear_prox interpolate in steps when given).
        """
        own = self._own(packed, current, step, version_to_step)
        prox, old = proximal_and_old(self.name, self.correction_kind, current,
                                     packed.rollout_log_prob, own.reference)
        return OldEstimate(prox, old, own.exact, own.extra, own.metrics)

    def correction_metrics(self, keep: torch.Tensor, weights: torch.Tensor | None,
                           engine_rejects: bool, old: torch.Tensor, mu: torch.Tensor,
                           mask: torch.Tensor) -> dict[str, float]:
        """Metrics the strategy measures on the applied correction (the correction's kept
        tokens ``keep``, IS ``weights``, whether it rejects tokens by π_prox/μ); none by
        default."""
        return {}

    def after_step(self, trained: bool, correction_metrics: Mapping[str, float]
                   ) -> dict[str, float]:
        """After the step's optimizer steps (``trained``: any was applied): update the
        strategy's state and return its metrics; none by default."""
        return {}

    def weights_synced(self, version: int, referenced: Sequence[int]) -> None:  # noqa: B027
        """The trainer's current weights went to the rollout engines as ``version``
        (``referenced``: the synced versions buffered samples still carry); no-op by default."""

    def held_bytes(self) -> int:
        """Bytes of the parameter copies the strategy itself holds besides the trainer's (the
        trainer's own snapshots are counted by the learner); 0 by default."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """The strategy's JSON-able checkpoint state (none: module docstring)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027
        """Restore :meth:`state_dict` (no-op by default)."""

    # --- shared forwards ---------------------------------------------------------------------
    def _log_probs_at_versions(self, engine: TrainEngine, packed: PackedBatch, ask: torch.Tensor,
                               current: torch.Tensor) -> torch.Tensor:
        """(B, T) ``current`` with the ``ask`` tokens replaced by ``engine``'s log-probs under
        each token's own version (one forward per distinct version over the rows asking)."""
        old = current.clone()
        if not bool(ask.any()):
            return old
        versions = packed.token_versions
        rows = ask.any(dim=1).nonzero().reshape(-1)
        # tokens not asked for get an asked version: their values are discarded
        filler = int(versions[ask][0])
        sub_versions = torch.where(ask[rows], versions[rows],
                                   torch.full_like(versions[rows], filler))
        res = engine.compute_log_probs(
            packed.batch.select(rows), routing=self.routing, version=sub_versions,
            temperature=self.temperature, with_entropy=False)
        old[rows] = torch.where(ask[rows], res.log_probs, old[rows])
        return old


# ------------------------------------------------------------------------------------------------
# The strategies
# ------------------------------------------------------------------------------------------------


class RecomputeOld(OldPolicy):
    """π_prox = π_old = π_current."""

    name = "recompute"
    needs_reference = False

    @staticmethod
    def pair(current, mu, reference):
        return current, current

    def _own(self, packed, current, step, version_to_step):
        # exact where the token's version is the one the step starts from
        return _Own(exact=packed.token_versions == self.engine.weight_version)


class BypassOld(OldPolicy):
    """π_prox = π_old = μ."""

    name = "bypass"
    needs_reference = False

    @staticmethod
    def pair(current, mu, reference):
        return mu, mu


class _ExactOld(OldPolicy):
    """π_prox = π_current, π_old the strategy's exact per-token π_{v_b} (with fallbacks)."""

    @staticmethod
    def pair(current, mu, reference):
        return current, reference

    def _exact(self, reference: torch.Tensor, fallback: torch.Tensor,
               metrics: dict[str, float]) -> _Own:
        return _Own(reference, ~fallback, {f"{self.name}_fallback_mask": fallback}, metrics)


class SnapshotOld(_ExactOld):
    """Exact π_old from the trainer's retained snapshots (seed 003 snapshots)."""

    name = "snapshot"
    metric_names = ("old/snapshot_fallback_frac",)

    def _own(self, packed, current, step, version_to_step):
        """Each loss token under the version that produced it. Tokens of the current version
        take π_current (same weights); tokens whose version the engine no longer retains fall
        back to π_current (``old/snapshot_fallback_frac`` = fallback tokens / loss tokens)."""
        mask = packed.batch.response_mask
        versions = packed.token_versions
        now = self.engine.weight_version
        stale = mask & (versions != now)
        retained = torch.tensor(sorted(self.engine.snapshot_versions()), dtype=torch.long)
        missing = stale & ~torch.isin(versions, retained)
        ask = stale & ~missing
        old = current.clone()
        try:
            old = self._log_probs_at_versions(self.engine, packed, ask, current)
        except SnapshotUnavailableError as e:
            log.warning("snapshot old log-probs unavailable (%s); using the current weights", e)
            missing = stale
        n_missing, frac = _fraction(missing, mask)
        if n_missing:
            gone = sorted(set(versions[missing].tolist()))
            log.warning("old_logprob snapshot: versions %s are not retained by the trainer; %d "
                        "loss tokens (%.1f%%) fall back to the current weights (raise "
                        "engines.snapshot_budget_mb)", gone, n_missing, 100 * frac)
        return self._exact(old, missing, {"old/snapshot_fallback_frac": frac})


class DedicatedOld(_ExactOld):
    """Exact π_old from the dedicated old-logit model (seed 003 §5.1): a second frozen engine
    on the trainer's backend and dtype, at the trainer's weights and version when made
    (:func:`training.engines.factory.make_old_logit_engine`), loaded with every synced
    version."""

    name = "dedicated"
    metric_names = ("old/dedicated_fallback_frac", "old/dedicated_versions",
                    "old/dedicated_bytes", "old/dedicated_s")

    def __init__(self, recipe: Recipe, engine: TrainEngine) -> None:
        super().__init__(recipe, engine)
        from training.engines.factory import make_old_logit_engine

        self.model: TrainEngine = make_old_logit_engine(recipe, engine)

    def weights_synced(self, version: int, referenced: Sequence[int]) -> None:
        """The old-logit model loads ``version`` and forgets the held versions that no buffered
        sample can carry any more."""
        assert self.engine.weight_version == version, (
            f"synced version {version} is not the trainer's current {self.engine.weight_version}")
        if version > self.model.weight_version:
            self.model.load_version(engine_params(self.engine), version)  # type: ignore
        keep = set(referenced) | {version}
        drop = [v for v in self.model.snapshot_versions() if v not in keep]
        if drop:
            self.model.drop_snapshots(drop)  # type: ignore[attr-defined]

    def held_bytes(self) -> int:
        return int(self.model.parameter_bytes())  # type: ignore[attr-defined]

    def _own(self, packed, current, step, version_to_step):
        """Each loss token under the synced version that produced it, computed by the model
        copy that holds it. Tokens of a version it no longer holds (a staleness beyond
        ``algorithm.dedicated_versions`` synced versions, or from before a resume) fall back to
        π_current, as snapshot's do. Runs in the trainer's process before the update (no
        overlap with training on the embedded backend). Metrics: ``old/dedicated_fallback_frac``
        (fallback tokens / loss tokens), ``old/dedicated_versions`` (versions held),
        ``old/dedicated_bytes`` (bytes of every parameter copy the model holds) and
        ``old/dedicated_s`` (seconds of its forwards)."""
        t0 = time.perf_counter()
        mask = packed.batch.response_mask
        versions = packed.token_versions
        held = [*self.model.snapshot_versions(), self.model.weight_version]
        ask = mask & torch.isin(versions, torch.tensor(held, dtype=torch.long))
        missing = mask & ~ask
        old = self._log_probs_at_versions(self.model, packed, ask, current)
        n_missing, frac = _fraction(missing, mask)
        if n_missing:
            gone = sorted(set(versions[missing].tolist()))
            log.warning("old_logprob dedicated: versions %s are not held by the old-logit model "
                        "(it holds %s); %d loss tokens (%.1f%%) fall back to the current weights "
                        "(raise algorithm.dedicated_versions)", gone, held, n_missing, 100 * frac)
        return self._exact(old, missing, {
            "old/dedicated_fallback_frac": frac,
            "old/dedicated_versions": float(len(held)),
            "old/dedicated_bytes": float(self.held_bytes()),
            "old/dedicated_s": time.perf_counter() - t0})


class InterruptOld(_ExactOld):
    """Exact π_old carried by the samples: the rollouter computed each token's log-prob under
    its own version before that version left the engines (``Sample.old_log_probs``)."""

    name = "interrupt"
    metric_names = ("old/interrupt_fallback_frac",)

    def _own(self, packed, current, step, version_to_step):
        """A sample without them (its ``old_log_probs`` do not cover its response: not
        expected) falls back to π_current (``old/interrupt_fallback_frac`` = fallback loss
        tokens / loss tokens)."""
        mask = packed.batch.response_mask
        old = current.clone()
        missing = torch.zeros_like(mask)
        for i, s in enumerate(packed.samples):
            o = s.response_len
            if len(s.old_log_probs) == o:
                old[i, :o] = torch.tensor(s.old_log_probs, dtype=old.dtype)
            else:
                missing[i] = mask[i]
        n_missing, frac = _fraction(missing, mask)
        if n_missing:
            log.warning("old_logprob interrupt: %d samples came without π_old; %d loss tokens "
                        "(%.1f%%) fall back to the current weights",
                        int(missing.any(dim=1).sum()), n_missing, 100 * frac)
        return self._exact(old, missing, {"old/interrupt_fallback_frac": frac})


class EwmaOld(OldPolicy):
    """The revised PPO-EWMA reference (seed 003 §5.2): an EWMA of the *parameters* replaces the
    unavailable π_old for both ratios. It lives here (engines exposing their parameters: the
    embedded trainer) or on the engine's ranks, each averaging its own shard (the Megatron
    engine: ``ewma_update`` + ``compute_log_probs_ewma``); the update rule is the same function
    either way."""

    name = "ewma"
    metric_names = ("old/ewma_beta", "old/ewma_resets", "old/ewma_updates_since_reset",
                    "old/ewma_mask_frac")

    def __init__(self, recipe: Recipe, engine: TrainEngine) -> None:
        super().__init__(recipe, engine)
        self.on_engine = hasattr(engine, "ewma_update") and hasattr(
            engine, "compute_log_probs_ewma")
        if not self.on_engine and not (
                hasattr(engine, "model") and hasattr(engine, "compute_log_probs_with_weights")):
            raise OldPolicyError(
                "old_logprob: ewma needs an engine that exposes its parameters and "
                "compute_log_probs_with_weights, or keeps the reference itself "
                "(ewma_update); use snapshot or recompute with this backend")
        ewma = recipe.algorithm.ewma
        self.config = EWMAConfig(staleness_window=ewma_staleness_window(recipe),
                                 reset_interval=ewma.reset_interval,
                                 reset_mask_frac=ewma.reset_mask_frac)
        self.resets = 0
        self.state: EWMAState = self._update(None, None)

    @staticmethod
    def pair(current, mu, reference):
        return reference, reference

    def _update(self, state: EWMAState | None, mask_frac: float | None) -> EWMAState:
        """One EWMA update (the first initialises); counts resets."""
        if self.on_engine:
            reset, since = self.engine.ewma_update(  # type: ignore[attr-defined]
                self.config, mask_frac)
            new = EWMAState({}, since)  # the reference itself stays on the engine
        else:
            new, reset = ewma_update(state, engine_params(self.engine), self.config,
                                     mask_frac=mask_frac)
        if state is not None:
            self.resets += int(reset)
        return new

    def _own(self, packed, current, step, version_to_step):
        """π_old under the EWMA parameters."""
        kw: dict[str, Any] = dict(routing=self.routing, with_entropy=False,
                                  temperature=self.temperature)
        if self.on_engine:
            res = self.engine.compute_log_probs_ewma(packed.batch, **kw)  # type: ignore
        else:
            res = self.engine.compute_log_probs_with_weights(  # type: ignore[attr-defined]
                packed.batch, self.state.reference, **kw)
        return _Own(res.log_probs)

    def correction_metrics(self, keep, weights, engine_rejects, old, mu, mask):
        """``old/ewma_mask_frac``, the train–inference mask rate that resets the reference: the
        correction's own rejections (π_prox = π_old = the reference under ewma); when it has no
        mask, the fraction of π_old/μ outside the default IcePop band [0.5, 5]."""
        if engine_rejects:
            frac = applied_weight_metrics(weights, keep, mask, prefix="")["mask_frac"]
        else:
            frac = compute_is_correction(old, mu, mask, "icepop").metrics["mask_frac"]
        return {"old/ewma_mask_frac": frac}

    def after_step(self, trained, correction_metrics):
        """ref ← β·ref + (1−β)·θ_new, or a reset (by interval, or by the mask rate
        ``old/ewma_mask_frac`` measured with the current reference); nothing when no optimizer
        step was applied."""
        if trained:
            self.state = self._update(self.state, correction_metrics.get("old/ewma_mask_frac"))
        return {"old/ewma_beta": self.config.beta,
                "old/ewma_resets": float(self.resets),
                "old/ewma_updates_since_reset": float(self.state.updates_since_reset)}

    def held_bytes(self) -> int:
        ref = self.state.reference
        if isinstance(ref, Mapping):  # parameters kept here, not on the engine's ranks
            return sum(t.numel() * t.element_size() for t in ref.values())
        return 0


class _InterpolatedOld(OldPolicy):
    """π_prox interpolated between μ and π_current by the version lag, π_old = μ."""

    metric_names = ("old/loglinear_alpha_mean",)
    interpolate: ClassVar[Callable[..., tuple[torch.Tensor, torch.Tensor]]]

    @staticmethod
    def pair(current, mu, reference):
        return reference, mu

    def _own(self, packed, current, step, version_to_step):
        # A-3PO / AReaL interpolate in policy versions = trainer steps (one step may hold
        # several optimizer steps): map weight versions to steps when the caller told us how
        if version_to_step is not None:
            behav = packed.token_versions.clone()
            for v in torch.unique(packed.token_versions).tolist():
                behav[packed.token_versions == v] = version_to_step(int(v))
            cur_v = step
        else:
            behav, cur_v = packed.token_versions, self.engine.weight_version
        mask = packed.batch.response_mask
        reference, alpha = type(self).interpolate(packed.rollout_log_prob, current, behav, cur_v,
                                                  mask)
        return _Own(reference, None, {"loglinear_alpha": alpha},
                    {"old/loglinear_alpha_mean": float(masked_mean(alpha, mask))})


class LoglinearOld(_InterpolatedOld):
    """A-3PO: log π_prox = log μ + α (log π_current − log μ)."""

    name = "loglinear"
    interpolate = staticmethod(loglinear_proximal_log_prob)


class LinearProxOld(_InterpolatedOld):
    """AReaL: π_prox = (1 − α) μ + α π_current, in probability space."""

    name = "linear_prox"
    interpolate = staticmethod(linear_proximal_log_prob)


STRATEGIES: dict[str, type[OldPolicy]] = {cls.name: cls for cls in (
    RecomputeOld, SnapshotOld, DedicatedOld, InterruptOld, EwmaOld, LoglinearOld,
    LinearProxOld, BypassOld)}
"""Strategy name → class, every value of :data:`training.recipe.OldLogprob`."""


def _strategy(name: str) -> type[OldPolicy]:
    cls = STRATEGIES.get(name)
    if cls is None:
        raise OldPolicyError(f"unknown old_logprob strategy {name!r}")
    return cls


def proximal_and_old(strategy: str, correction_kind: str, current: torch.Tensor,
                     mu: torch.Tensor, reference: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(π_prox, π_old) of an old-log-prob strategy and a correction kind (module docstring).

    Args:
        strategy: a value of :data:`training.recipe.OldLogprob`.
        correction_kind: ``algorithm.correction.kind``; ``decoupled_mis`` centres the PPO clip at
            π_old (seed 003 Eq. 4), every other kind keeps the strategy's π_prox.
        current: (B, T) π_current. mu: (B, T) rollout log-probs.
        reference: (B, T) the strategy's own policy: the exact per-token π_old (snapshot,
            dedicated, interrupt), the EWMA reference (ewma), the interpolated proximal policy
            (loglinear, linear_prox); unused otherwise.
    """
    cls = STRATEGIES.get(strategy)
    if cls is not None and cls.needs_reference and reference is None:
        raise OldPolicyError(f"old_logprob {strategy} needs its reference log-probs")
    prox, old = _strategy(strategy).pair(current, mu, reference)
    assert prox is not None and old is not None
    if correction_kind == "decoupled_mis":
        prox = old
    return prox, old


def old_policy(recipe: Recipe, engine: TrainEngine) -> OldPolicy:
    """The strategy object of ``recipe.algorithm.effective_old_logprob`` on ``engine``."""
    return _strategy(recipe.algorithm.effective_old_logprob)(recipe, engine)
