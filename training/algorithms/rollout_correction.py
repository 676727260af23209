"""Rollout correction: importance-sampling (IS) weights, rejection sampling (RS) and diagnostics
for the gap between the rollout engine's policy and the training engine's policy.

Spec: seed 001, "Identifying mismatch — a diagnostic toolkit" and "Correcting mismatch — the
rollout correction framework". The configuration surface, preset names, metric key names and
default thresholds follow verl's rollout correction (``verl/trainer/ppo/rollout_corr_helper.py`` and
``RolloutCorrectionConfig`` in ``verl/trainer/config/algorithm.py``, verl-project/verl@70744059) so
that runs migrated from verl keep their configs and dashboards. This module is an independent
implementation written from those semantics.

Notation (seed 001): B sequences × T response tokens, ``response_mask`` (B, T),
``old_log_prob`` = log π_old recomputed by the training engine, ``rollout_log_prob`` = log π_rollout
recorded by the inference engine. The per-token log importance ratio is

    log ρ_t = log π_old(y_t | x, y_<t) − log π_rollout(y_t | x, y_<t),  clamped to ±20

(``LOG_RATIO_BOUND``; e^20 ≈ 4.85e8). Everything ratio-shaped is computed in log space with that
bound.

Two orthogonal tools (seed 001 "Architecture overview"):

* IS weights (``rollout_is``): ``"token"`` → w_t = min(ρ_t, C) (token TIS, Yao et al. 2025,
  "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"); ``"sequence"`` →
  w = min(exp(clamp(Σ_t log ρ_t, ±20)), C) broadcast to every token of the sequence (sequence TIS).
  A ``"lo_hi"`` threshold string (e.g. ``"0.5_5.0"``) selects IcePop instead of truncation
  (Ring-1T report, arXiv:2510.18855, §2.3.2): M(ρ) = ρ inside [lo, hi], 0 outside.
* RS masks (``rollout_rs``): token divergences d_k1 = −log ρ, d_k2 = ½(log ρ)², d_k3 = ρ − log ρ − 1
  (Schulman 2020, "Approximating KL divergence"), used per token (``token_k*``) or aggregated per
  sequence by sum / mean / max (``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k*``). A rejected
  sequence loses its whole response mask; a rejected token (``token_k*``) only itself.
  ``seq_mean_*`` is the length-invariant "geometric" criterion (Li & Liu 2025, "When Speed Kills
  Stability").

Deliberate differences from verl (the seed, or our masking contract, wins):

* ``RolloutCorrectionConfig()`` defaults to metrics-only (``rollout_is=None``), as the seed states
  for verl's ``rollout_correction.yaml``; verl's dataclass default is ``rollout_is="sequence"``.
* Per-sequence statistics (PPL, ``log_ppl_*``, ``chi2_seq``, ``rollout_is_seq_*``, sequence-level
  IS fractions, ``rollout_rs_seq_masked_fraction``) average over sequences with ≥ 1 valid token;
  verl also averages rows with no valid token (which enter as ratio 1 / weight 0).
* The ±20 bound is applied per token *before* the sequence sum (and again to the sum), and every
  ratio-derived metric (``kl``, ``k3_kl``, ``log_ppl_diff`` …) uses the bounded log ratio, so an
  infinite log-prob at a valid position cannot produce inf/NaN. verl sums unbounded token log
  ratios. The two agree whenever every valid |log ρ_t| ≤ 20.
* A batch with no valid token returns neutral, finite metrics instead of raising, and
  ``rollout_is_eff_sample_size`` is 0 when every applied weight is 0 (an IcePop band that masks
  everything), where verl divides by zero.
* ``rollout_is_std`` / ``rollout_rs_*_std`` are the exact population std; verl's masked means add
  1e-8 to the count, which leaves a small floor (≈2e-5 for identical policies) in those stds.
* ``__post_init__`` validates eagerly (thresholds parsed at construction) and also rejects
  ``loss_type="reinforce"`` or ``debug_rollout_actor_probs=True`` outside bypass mode, where verl
  silently ignores them.
* ``rollout_rs`` accepts the 11 modes of the seed; verl's later ``binary_kl`` option is not offered.
* The returned ``modified_response_mask`` is ``bool``.

Added (not in verl) because the package conventions ask for tails of heavy-tailed quantities:
``rollout_corr/rho_token_{mean,p50,p90,p99,max}`` (raw token ratio ρ_t) and
``rollout_corr/rollout_is_{p50,p90,p99}`` (applied IS weights), over valid tokens.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .masked import (
    LOG_RATIO_BOUND,
    as_bool_mask,
    clamped_log_ratio,
    masked_count,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    sanitize,
    tail_stats,
)

__all__ = [
    "IS_LEVELS",
    "LOSS_TYPES",
    "METRIC_PREFIX",
    "PRESETS",
    "RS_MODES",
    "RSOption",
    "RolloutCorrectionConfig",
    "apply_bypass_mode",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rs_divergence",
    "compute_rs_metrics",
    "from_preset",
    "parse_is_threshold",
    "parse_rs_options",
]

METRIC_PREFIX = "rollout_corr/"
"""Prefix of every metric key returned by :func:`compute_rollout_correction_and_rejection_mask`."""

IS_LEVELS: tuple[str, ...] = ("token", "sequence")
LOSS_TYPES: tuple[str, ...] = ("ppo_clip", "reinforce")

RS_MODES: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""The 11 rejection-sampling modes of seed 001 (aggregation × estimator; no ``seq_max_k1``)."""

Divergence = Literal["k1", "k2", "k3"]
Aggregation = Literal["token", "seq_sum", "seq_mean", "seq_max"]


# ----------------------------------------------------------------------------------------------
# Threshold parsing
# ----------------------------------------------------------------------------------------------


def _to_positive_float(text: str | float, what: str, fix: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: cannot parse {text!r} as a number; {fix}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}: bounds must be positive and finite, got {text!r}; {fix}")
    return value


def parse_is_threshold(spec: str | float) -> tuple[float | None, float]:
    """Parse ``rollout_is_threshold`` into ``(lower, upper)``.

    A number (or number-like string) C means truncation, ``(None, C)``; a ``"lo_hi"`` string means
    an IcePop band ``(lo, hi)``. Raises ValueError (with the fix) on anything else.
    """
    fix = "use a positive float like 2.0 (truncation) or a 'lo_hi' string like '0.5_5.0' (IcePop)"
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"rollout_is_threshold must be a float or a string, got {spec!r}; {fix}")
    if isinstance(spec, str):
        text = spec.strip()
        if "_" in text:
            lo_text, hi_text = text.split("_", 1)
            lower = _to_positive_float(lo_text, "rollout_is_threshold", fix)
            upper = _to_positive_float(hi_text, "rollout_is_threshold", fix)
            if lower > upper:
                raise ValueError(
                    f"rollout_is_threshold {spec!r}: lower bound exceeds upper bound; "
                    f"write it as 'lower_upper', e.g. '0.5_5.0'"
                )
            return lower, upper
        return None, _to_positive_float(text, "rollout_is_threshold", fix)
    return None, _to_positive_float(spec, "rollout_is_threshold", fix)


@dataclass(frozen=True)
class RSOption:
    """One parsed rejection-sampling criterion.

    ``lower``/``upper`` are in the units the user wrote: ratio bounds for K1 (compared in log
    space with the aggregated −log ρ), divergence upper bounds for K2/K3 (``lower`` is None).
    """

    name: str
    divergence: Divergence
    aggregation: Aggregation
    lower: float | None
    upper: float

    @property
    def is_token_level(self) -> bool:
        return self.aggregation == "token"


def _split_mode(name: str) -> tuple[Aggregation, Divergence]:
    aggregation, divergence = name.rsplit("_", 1)
    return aggregation, divergence  # type: ignore[return-value]


def parse_rs_options(
    rollout_rs: str | None, rollout_rs_threshold: str | float | None
) -> tuple[RSOption, ...]:
    """Parse ``rollout_rs`` / ``rollout_rs_threshold`` into one :class:`RSOption` per mode.

    ``rollout_rs`` is one mode or a comma-separated list (duplicates dropped, every criterion must
    pass). ``rollout_rs_threshold`` holds one entry shared by all modes or one per mode (comma
    separated). K1 entries are ``"lo_hi"`` ratio bounds, or a single upper bound u meaning
    [1/u, u]; K2/K3 entries are a single positive upper bound.
    """
    if rollout_rs is None:
        return ()
    if not isinstance(rollout_rs, str):
        raise ValueError(
            f"rollout_rs must be None or a string, got {rollout_rs!r}; "
            f"give one mode or a comma-separated list, e.g. 'seq_mean_k1,token_k3'"
        )
    names: list[str] = []
    for part in rollout_rs.split(","):
        name = part.strip()
        if not name:
            continue
        if name not in RS_MODES:
            raise ValueError(
                f"unknown rollout_rs mode {name!r}; valid modes: {', '.join(RS_MODES)}"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("rollout_rs is empty; set it to None or name a mode, e.g. 'seq_mean_k1'")
    if rollout_rs_threshold is None or isinstance(rollout_rs_threshold, bool):
        raise ValueError(
            f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold; e.g. '0.999_1.001' for "
            f"seq_mean_k1 or 0.01 for seq_mean_k3"
        )
    if isinstance(rollout_rs_threshold, int | float):
        specs = [str(float(rollout_rs_threshold))]
    elif isinstance(rollout_rs_threshold, str):
        specs = [s.strip() for s in rollout_rs_threshold.split(",") if s.strip()]
    else:
        raise ValueError(
            f"rollout_rs_threshold must be a float or a string, got {rollout_rs_threshold!r}; "
            f"e.g. '0.999_1.001' or 0.01"
        )
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} entries for {len(names)} rollout_rs modes; "
            f"give one shared entry or exactly one per mode (comma separated)"
        )
    options: list[RSOption] = []
    for name, spec in zip(names, specs, strict=True):
        aggregation, divergence = _split_mode(name)
        what = f"rollout_rs_threshold for {name}"
        if divergence == "k1":
            fix = "use ratio bounds 'lower_upper' like '0.999_1.001', or one upper bound u > 1"
            if "_" in spec:
                lo_text, hi_text = spec.split("_", 1)
                lower = _to_positive_float(lo_text, what, fix)
                upper = _to_positive_float(hi_text, what, fix)
            else:
                upper = _to_positive_float(spec, what, fix)
                lower = 1.0 / upper
            if lower > upper:
                raise ValueError(f"{what}: lower bound {lower} exceeds upper bound {upper}; {fix}")
            options.append(RSOption(name, divergence, aggregation, lower, upper))
        else:
            fix = "use a single positive upper bound such as 0.01 (no 'lower_upper' for k2/k3)"
            if "_" in spec:
                raise ValueError(f"{what}: {spec!r} has a lower bound; {fix}")
            upper = _to_positive_float(spec, what, fix)
            options.append(RSOption(name, divergence, aggregation, None, upper))
    return tuple(options)


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout correction settings (seed 001; field names and meaning as in verl).

    Build it from a preset (``RolloutCorrectionConfig.decoupled_geo_rs()``, :func:`from_preset`)
    or field by field. The default is metrics-only: no IS weights, no rejection.
    """

    rollout_is: Literal["token", "sequence"] | None = None
    """IS weight level: None (no weights), ``"token"`` (token TIS) or ``"sequence"`` (seq TIS)."""

    rollout_is_threshold: float | str = 2.0
    """Upper truncation C (float, typical 1.5–5 token / 2–10 sequence), or a ``"lo_hi"`` IcePop
    band such as ``"0.5_5.0"`` (weight ρ kept inside the band, 0 outside)."""

    rollout_is_batch_normalize: bool = False
    """Rescale the IS weights to mean 1 over valid tokens (token level) or valid sequences
    (sequence level) after truncation."""

    rollout_rs: str | None = None
    """None, one of :data:`RS_MODES`, or a comma-separated list of them (all must pass)."""

    rollout_rs_threshold: float | str | None = None
    """One entry shared by all RS modes or one per mode (comma separated). K1 modes: ratio bounds
    ``"lo_hi"`` (or u meaning [1/u, u]); K2/K3 modes: a single upper bound on the divergence."""

    bypass_mode: bool = False
    """True: bypass mode (2 policies, old_log_prob := rollout_log_prob, correction applied inside
    the ``bypass_mode`` policy loss). False: decoupled mode (3 policies)."""

    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Bypass-mode loss: ``"ppo_clip"`` (ratio π_θ/π_rollout inside the clip, no explicit IS
    weights) or ``"reinforce"`` (explicit IS weights × log π_θ × A)."""

    debug_rollout_actor_probs: bool = False
    """Bypass mode only: ask the trainer for one extra no-grad actor forward to log
    rollout-vs-actor probability diagnostics. Does not change the training math."""

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(
                f"rollout_is={self.rollout_is!r} is not valid; use None, 'token' or 'sequence'"
            )
        parse_is_threshold(self.rollout_is_threshold)
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise ValueError("rollout_is_batch_normalize must be True or False")
        parse_rs_options(self.rollout_rs, self.rollout_rs_threshold)
        if not isinstance(self.bypass_mode, bool):
            raise ValueError("bypass_mode must be True or False")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"loss_type={self.loss_type!r} is not valid; use 'ppo_clip' or 'reinforce'"
            )
        if self.loss_type == "reinforce" and not self.bypass_mode:
            raise ValueError(
                "loss_type='reinforce' only applies in bypass mode; set bypass_mode=True "
                "or keep loss_type='ppo_clip'"
            )
        if self.debug_rollout_actor_probs and not self.bypass_mode:
            raise ValueError(
                "debug_rollout_actor_probs only applies in bypass mode; set bypass_mode=True or "
                "leave it False (decoupled mode already has the actor log-probs)"
            )

    # ---- parsed views -------------------------------------------------------------------------

    @property
    def is_bounds(self) -> tuple[float | None, float]:
        """``(lower, upper)`` of the IS threshold; ``lower`` is None for truncation (TIS)."""
        return parse_is_threshold(self.rollout_is_threshold)

    @property
    def uses_icepop(self) -> bool:
        """True when IS weights use an IcePop band rather than truncation."""
        return self.rollout_is is not None and self.is_bounds[0] is not None

    @property
    def rs_options(self) -> tuple[RSOption, ...]:
        """The parsed RS criteria (empty when ``rollout_rs`` is None)."""
        return parse_rs_options(self.rollout_rs, self.rollout_rs_threshold)

    @property
    def is_enabled(self) -> bool:
        """True when the config changes weights or masks (False: metrics only)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    # ---- presets (seed 001 "The full set of configuration presets"; defaults as verl's) --------

    @classmethod
    def bypass_ppo_clip(cls) -> RolloutCorrectionConfig:
        """Bypass, PPO-clip loss, no IS weights, no RS."""
        return cls(rollout_is=None, rollout_rs=None, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(
        cls, rs_threshold: str | float = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Bypass, PPO-clip loss, geometric-mean RS (``seq_mean_k1``)."""
        return cls(
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="ppo_clip",
        )

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float | str = 0.01) -> RolloutCorrectionConfig:
        """Bypass, PPO-clip loss, K3 RS (``seq_mean_k3``)."""
        return cls(
            rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="ppo_clip",
        )

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Bypass, REINFORCE loss, sequence TIS (C = ``threshold``)."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: str | float = "0.999_1.001") -> RolloutCorrectionConfig:
        """Bypass, REINFORCE loss, geometric-mean RS (``seq_mean_k1``), no IS weights."""
        return cls(
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Bypass, REINFORCE loss, sequence TIS + geometric-mean RS."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Bypass, REINFORCE loss, token TIS + geometric-mean RS."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Decoupled, token TIS (C = ``threshold``)."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Decoupled, sequence TIS (C = ``threshold``)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is_rs(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.5_2.0"
    ) -> RolloutCorrectionConfig:
        """Decoupled, sequence TIS + sequence-sum K1 RS (``seq_sum_k1``)."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_sum_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: str | float = "0.999_1.001") -> RolloutCorrectionConfig:
        """Decoupled, geometric-mean RS (``seq_mean_k1``), no IS weights."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Decoupled, sequence TIS + geometric-mean RS."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Decoupled, token TIS + geometric-mean RS."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float | str = 0.01) -> RolloutCorrectionConfig:
        """Decoupled, K3 RS (``seq_mean_k3``), no IS weights."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float | str = 0.01
    ) -> RolloutCorrectionConfig:
        """Decoupled, sequence TIS + K3 RS."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_k3_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float | str = 0.01
    ) -> RolloutCorrectionConfig:
        """Decoupled, token TIS + K3 RS."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_token_icepop(
        cls, threshold: float = 5.0, threshold_lower: float = 0.5
    ) -> RolloutCorrectionConfig:
        """Decoupled, token IcePop band [threshold_lower, threshold] (response mask untouched)."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}")

    @classmethod
    def bypass_pg_token_icepop(
        cls, threshold: float = 5.0, threshold_lower: float = 0.5
    ) -> RolloutCorrectionConfig:
        """Bypass, REINFORCE loss, token IcePop band [threshold_lower, threshold]."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=f"{threshold_lower}_{threshold}",
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def disabled(cls) -> RolloutCorrectionConfig:
        """Metrics only: no IS weights, no rejection."""
        return cls(rollout_is=None, rollout_rs=None)


PRESETS: dict[str, Callable[..., RolloutCorrectionConfig]] = {
    name: getattr(RolloutCorrectionConfig, name)
    for name in (
        "bypass_ppo_clip",
        "bypass_ppo_clip_geo_rs",
        "bypass_ppo_clip_k3_rs",
        "bypass_pg_is",
        "bypass_pg_geo_rs",
        "bypass_pg_geo_rs_seq_tis",
        "bypass_pg_geo_rs_token_tis",
        "decoupled_token_is",
        "decoupled_seq_is",
        "decoupled_seq_is_rs",
        "decoupled_geo_rs",
        "decoupled_geo_rs_seq_tis",
        "decoupled_geo_rs_token_tis",
        "decoupled_k3_rs",
        "decoupled_k3_rs_seq_tis",
        "decoupled_k3_rs_token_tis",
        "decoupled_token_icepop",
        "bypass_pg_token_icepop",
        "disabled",
    )
}
"""Preset name → constructor, exactly the rows of seed 001's preset table."""


def from_preset(name: str, **overrides: Any) -> RolloutCorrectionConfig:
    """Build a preset by name.

    ``overrides`` may be the preset's own keyword thresholds (e.g. ``is_threshold``,
    ``rs_threshold``, ``threshold``, ``threshold_lower``) and/or any config field
    (e.g. ``rollout_is_batch_normalize=True``), applied on top of the preset.
    Raises KeyError listing the presets for an unknown name, ValueError for an unknown override.
    """
    try:
        ctor = PRESETS[name]
    except KeyError:
        raise KeyError(
            f"unknown rollout correction preset {name!r}; valid presets: {', '.join(PRESETS)}"
        ) from None
    preset_params = set(inspect.signature(ctor).parameters)
    field_names = {f.name for f in dataclasses.fields(RolloutCorrectionConfig)}
    unknown = set(overrides) - preset_params - field_names
    if unknown:
        raise ValueError(
            f"unknown override(s) {sorted(unknown)} for preset {name!r}; preset arguments: "
            f"{sorted(preset_params)}, config fields: {sorted(field_names)}"
        )
    preset_kwargs = {k: v for k, v in overrides.items() if k in preset_params}
    field_kwargs = {k: v for k, v in overrides.items() if k not in preset_params}
    config = ctor(**preset_kwargs)
    return dataclasses.replace(config, **field_kwargs) if field_kwargs else config


# ----------------------------------------------------------------------------------------------
# Small helpers (metrics are computed in float64 on detached copies)
# ----------------------------------------------------------------------------------------------


def _f(x: torch.Tensor) -> float:
    return float(x.detach().item())


def _seq_mean(values: torch.Tensor, seq_valid: torch.Tensor) -> float:
    """Mean of a (B,) tensor over valid sequences (0.0 when there is none)."""
    return _f(masked_mean(values, seq_valid))


def _seq_std(values: torch.Tensor, seq_valid: torch.Tensor) -> float:
    """Bessel-corrected std of a (B,) tensor over valid sequences (0.0 with fewer than two)."""
    v = values[seq_valid]
    return _f(v.std()) if v.numel() > 1 else 0.0


def _max_or_zero(values: torch.Tensor, mask: torch.Tensor) -> float:
    return _f(masked_max(values, mask)) if bool(as_bool_mask(mask).any()) else 0.0


def _min_or_zero(values: torch.Tensor, mask: torch.Tensor) -> float:
    return _f(masked_min(values, mask)) if bool(as_bool_mask(mask).any()) else 0.0


def _masked_pop_std(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Population std over valid positions (0.0 with fewer than two valid positions)."""
    if int(masked_count(mask)) <= 1:
        return 0.0
    mean = masked_mean(values, mask)
    var = masked_mean(values.square(), mask) - mean.square()
    return _f(var.clamp(min=0.0).sqrt())


def _tails(values: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, float]:
    """``tail_stats`` on a CPU copy: one small device→host transfer, after which the quantile
    sort and the float conversions run on the host."""
    return tail_stats(values.detach().cpu(), mask.cpu(), prefix=prefix)


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) clamp(Σ_t log ρ_t, ±20) over valid tokens (the per-token ratios are already bounded)."""
    return masked_sum(log_ratio, mask, dim=-1).clamp(min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)


# ----------------------------------------------------------------------------------------------
# Off-policy diagnostics
# ----------------------------------------------------------------------------------------------


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Mismatch diagnostics between the training (old) and rollout policies (seed 001).

    Args:
        old_log_prob: (B, T) log π_old of the sampled tokens (training engine).
        rollout_log_prob: (B, T) log π_rollout (inference engine), or None (then only the
            training-policy perplexity keys are returned).
        response_mask: (B, T) response mask.

    Returns (unprefixed keys, verl's names), with log ρ_t = clamp(old − rollout, ±20):
        ``training_ppl`` = mean_seq exp(−mean_t log π_old); ``training_log_ppl`` = mean_seq(−mean_t
        log π_old); ``rollout_ppl`` / ``rollout_log_ppl`` likewise for π_rollout;
        ``kl`` = mean_tok(−log ρ) (k1 estimate of KL(π_rollout ‖ π_old));
        ``k3_kl`` = mean_tok(ρ − log ρ − 1);
        ``log_ppl_diff`` = mean_seq(δ_i) with δ_i = mean_t(−log ρ_t)
        = log(PPL_old,i / PPL_rollout,i), plus ``log_ppl_abs_diff`` = mean|δ_i|,
        ``log_ppl_diff_max`` / ``_min``; ``ppl_ratio`` = mean_seq exp(δ_i)
        = mean_seq PPL_old,i / PPL_rollout,i (seed: PPL_old / PPL_rollout);
        ``chi2_token`` = mean_tok ρ² − 1;
        ``chi2_seq`` = mean_seq exp(2·clamp(Σ_t log ρ_t, ±20)) − 1;
        ``rho_token_{mean,p50,p90,p99,max}`` = tails of ρ_t over valid tokens (added, not verl).
        Sequence means run over sequences with ≥ 1 valid token.
    """
    mask = as_bool_mask(response_mask)
    seq_valid = mask.any(dim=-1)
    old = sanitize(old_log_prob.detach().to(torch.float64), mask)
    metrics: dict[str, float] = {}

    mean_old = masked_mean(old, mask, dim=-1)  # (B,) mean_t log π_old
    metrics["training_ppl"] = _seq_mean(torch.exp(-mean_old), seq_valid)
    metrics["training_log_ppl"] = _seq_mean(-mean_old, seq_valid)
    if rollout_log_prob is None:
        return metrics

    rollout = sanitize(rollout_log_prob.detach().to(torch.float64), mask)
    log_ratio = clamped_log_ratio(old, rollout, mask)  # (B, T) log ρ_t, bounded
    rho = sanitize(torch.exp(log_ratio), mask)

    # k1: E[log π_rollout − log π_old];  k3: E[ρ − log ρ − 1]  (Schulman 2020)
    metrics["kl"] = _f(masked_mean(-log_ratio, mask))
    metrics["k3_kl"] = _f(masked_mean(rho - log_ratio - 1.0, mask))

    mean_rollout = masked_mean(rollout, mask, dim=-1)
    metrics["rollout_ppl"] = _seq_mean(torch.exp(-mean_rollout), seq_valid)
    metrics["rollout_log_ppl"] = _seq_mean(-mean_rollout, seq_valid)

    # δ_i = log PPL_old,i − log PPL_rollout,i = mean_t(log π_rollout − log π_old)
    log_ppl_diff = masked_mean(-log_ratio, mask, dim=-1)
    metrics["log_ppl_diff"] = _seq_mean(log_ppl_diff, seq_valid)
    metrics["log_ppl_abs_diff"] = _seq_mean(log_ppl_diff.abs(), seq_valid)
    metrics["log_ppl_diff_max"] = _max_or_zero(log_ppl_diff, seq_valid)
    metrics["log_ppl_diff_min"] = _min_or_zero(log_ppl_diff, seq_valid)
    metrics["ppl_ratio"] = _seq_mean(torch.exp(log_ppl_diff), seq_valid) if seq_valid.any() else 1.0

    # χ²_token = E_tok[ρ²] − 1;  χ²_seq = E_seq[(Π_t ρ_t)²] − 1  (bounded in log space)
    metrics["chi2_token"] = _f(masked_mean(rho.square(), mask)) - 1.0 if mask.any() else 0.0
    seq_log_ratio = _sequence_log_ratio(log_ratio, mask)
    metrics["chi2_seq"] = (
        _seq_mean(torch.exp(2.0 * seq_log_ratio), seq_valid) - 1.0 if seq_valid.any() else 0.0
    )
    metrics.update(_tails(rho, mask, "rho_token_"))
    return metrics


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Off-policy diagnostics of the *current* policy against the rollout policy, prefixed.

    Args:
        log_prob: (B, T) log π_θ of the sampled tokens (current policy, any grad is ignored).
        rollout_log_prob: (B, T) log π_rollout.
        response_mask: (B, T) response mask.
    Returns:
        :func:`compute_offpolicy_metrics` with every key prefixed by ``rollout_corr/``.
    """
    metrics = compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask)
    return {f"{METRIC_PREFIX}{k}": v for k, v in metrics.items()}


# ----------------------------------------------------------------------------------------------
# Importance sampling weights
# ----------------------------------------------------------------------------------------------


def compute_is_metrics(
    is_weights: torch.Tensor,
    raw_is_weights: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str,
    threshold: float,
    threshold_lower: float | None = None,
    seq_log_ratio: torch.Tensor | None = None,
) -> dict[str, float]:
    """Health metrics of the applied IS weights (seed 001 "IS weight health"; verl key names).

    Args:
        is_weights: (B, T) applied weights (after truncation / IcePop, before batch normalisation).
        raw_is_weights: (B, T) weights before truncation / IcePop (ρ_t, or the sequence ratio
            broadcast to tokens).
        response_mask: (B, T) response mask.
        rollout_is: ``"token"`` or ``"sequence"``.
        threshold: upper bound C (TIS) or the band's upper bound (IcePop).
        threshold_lower: the band's lower bound (IcePop); for TIS the low diagnostic uses 1/C.
        seq_log_ratio: (B,) bounded Σ_t log ρ_t; needed for ``rollout_is="sequence"``.

    Returns (unprefixed):
        ``rollout_is_mean`` (token-weighted mean of the applied weights), ``rollout_is_max`` /
        ``rollout_is_min`` (token level: applied weights; sequence level: the untruncated
        sequence ratio, as verl), ``rollout_is_ratio_fraction_high`` / ``_low`` (fraction of
        tokens — sequences at sequence level — whose raw ratio is above C / below the lower bound),
        ``rollout_is_std`` (population std over valid tokens), ``rollout_is_eff_sample_size`` =
        1 / mean(w̃²) with w̃ = w / mean(w) over valid tokens (0 when every weight is 0),
        ``rollout_is_seq_{mean,std,max,min}`` and ``rollout_is_seq_max_deviation`` (= max|s_i − 1|)
        of the per-sequence mean weight s_i, ``rollout_is_seq_fraction_high`` / ``_low`` (per-
        sequence mean *raw* weight above C / below the lower bound), and the added tails
        ``rollout_is_{p50,p90,p99}``.
    """
    mask = as_bool_mask(response_mask)
    seq_valid = mask.any(dim=-1)
    w = sanitize(is_weights.detach().to(torch.float64), mask)
    raw = sanitize(raw_is_weights.detach().to(torch.float64), mask)
    lower = (1.0 / threshold) if threshold_lower is None else threshold_lower
    metrics: dict[str, float] = {}

    metrics["rollout_is_mean"] = _f(masked_mean(w, mask))
    if rollout_is == "sequence":
        if seq_log_ratio is None:
            raise ValueError("compute_is_metrics(rollout_is='sequence') needs seq_log_ratio (B,)")
        slr = seq_log_ratio.detach().to(torch.float64)
        metrics["rollout_is_max"] = math.exp(_max_or_zero(slr, seq_valid))
        metrics["rollout_is_min"] = math.exp(_min_or_zero(slr, seq_valid))
        metrics["rollout_is_ratio_fraction_high"] = _seq_mean(
            (slr > math.log(threshold)).to(torch.float64), seq_valid
        )
        metrics["rollout_is_ratio_fraction_low"] = _seq_mean(
            (slr < math.log(lower)).to(torch.float64), seq_valid
        )
    else:
        metrics["rollout_is_ratio_fraction_high"] = _f(
            masked_mean((raw > threshold).to(torch.float64), mask)
        )
        metrics["rollout_is_ratio_fraction_low"] = _f(
            masked_mean((raw < lower).to(torch.float64), mask)
        )
        metrics["rollout_is_max"] = _max_or_zero(w, mask)
        metrics["rollout_is_min"] = _min_or_zero(w, mask)

    metrics["rollout_is_std"] = _masked_pop_std(w, mask)
    # ESS = 1 / E[w̃²],  w̃ = w / E[w]  ⇔  ESS = E[w]² / E[w²]   (seed 001)
    mean_w = masked_mean(w, mask)
    mean_w2 = masked_mean(w.square(), mask)
    if not mask.any():
        metrics["rollout_is_eff_sample_size"] = 1.0
    elif _f(mean_w2) > 0.0:
        metrics["rollout_is_eff_sample_size"] = _f(mean_w.square() / mean_w2)
    else:
        metrics["rollout_is_eff_sample_size"] = 0.0

    seq_w = masked_mean(w, mask, dim=-1)  # (B,) per-sequence mean applied weight
    metrics["rollout_is_seq_mean"] = _seq_mean(seq_w, seq_valid)
    metrics["rollout_is_seq_std"] = _seq_std(seq_w, seq_valid)
    metrics["rollout_is_seq_max"] = _max_or_zero(seq_w, seq_valid)
    metrics["rollout_is_seq_min"] = _min_or_zero(seq_w, seq_valid)
    metrics["rollout_is_seq_max_deviation"] = _max_or_zero((seq_w - 1.0).abs(), seq_valid)
    raw_seq_w = masked_mean(raw, mask, dim=-1)
    metrics["rollout_is_seq_fraction_high"] = _seq_mean(
        (raw_seq_w > threshold).to(torch.float64), seq_valid
    )
    metrics["rollout_is_seq_fraction_low"] = _seq_mean(
        (raw_seq_w < lower).to(torch.float64), seq_valid
    )
    tails = _tails(w, mask, "rollout_is_")
    for q in ("p50", "p90", "p99"):
        metrics[f"rollout_is_{q}"] = tails[f"rollout_is_{q}"]
    return metrics


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated (TIS) or band-masked (IcePop) IS weights, detached.

    Args:
        log_ratio: (B, T) log π_old − log π_rollout (clamped to ±20 here).
        response_mask: (B, T) response mask.
        rollout_is: ``"token"``: ρ_t = exp(log ρ_t);  ``"sequence"``: exp(clamp(Σ_t log ρ_t, ±20))
            broadcast to the sequence's tokens.
        rollout_is_threshold: C → w = min(ρ, C) (Yao et al. 2025); ``"lo_hi"`` → w = ρ if
            lo ≤ ρ ≤ hi else 0 (IcePop, arXiv:2510.18855). IcePop only zeroes weights; the
            response mask is not changed (as verl: out-of-band tokens still count in the loss
            normaliser but contribute no gradient).
        rollout_is_batch_normalize: divide by the mean weight over valid tokens (token level) or
            over valid sequences (sequence level) so it becomes 1; skipped when that mean ≤ 1e-8.

    Returns:
        weights (B, T): detached, 0 at masked positions, same dtype as ``log_ratio``.
        metrics: :func:`compute_is_metrics` (computed before batch normalisation), plus
            ``rollout_is_oob_ratio`` (IcePop: fraction of valid tokens outside the band) and
            ``rollout_is_batch_norm_factor`` (when normalising).
    """
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r} is not valid; use 'token' or 'sequence'")
    lower, upper = parse_is_threshold(rollout_is_threshold)
    mask = as_bool_mask(response_mask)
    lr = clamped_log_ratio(log_ratio.detach(), torch.zeros_like(log_ratio), mask)

    seq_lr: torch.Tensor | None = None
    if rollout_is == "token":
        raw = torch.exp(lr)  # ρ_t
    else:
        seq_lr = _sequence_log_ratio(lr, mask)  # (B,) log Π_t ρ_t, bounded
        raw = torch.exp(seq_lr).unsqueeze(-1).expand_as(lr)
    raw = sanitize(raw, mask)

    if lower is None:
        weights = raw.clamp(max=upper)  # TIS: w = min(ρ, C)
    else:
        in_band = (raw >= lower) & (raw <= upper)  # IcePop: M(ρ) = ρ·1[lo ≤ ρ ≤ hi]
        weights = torch.where(in_band, raw, torch.zeros_like(raw))
    weights = sanitize(weights, mask).detach()

    metrics = compute_is_metrics(
        weights,
        raw,
        mask,
        rollout_is=rollout_is,
        threshold=upper,
        threshold_lower=lower,
        seq_log_ratio=seq_lr,
    )
    if lower is not None:
        out_of_band = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = _f(masked_mean(out_of_band.to(torch.float64), mask))

    if rollout_is_batch_normalize:
        if rollout_is == "token":
            norm = masked_mean(weights, mask)
        else:
            norm = masked_mean(masked_mean(weights, mask, dim=-1), mask.any(dim=-1))
        if _f(norm) > 1e-8:
            weights = weights / norm
            metrics["rollout_is_batch_norm_factor"] = _f(norm)
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights.detach(), metrics


# ----------------------------------------------------------------------------------------------
# Rejection sampling
# ----------------------------------------------------------------------------------------------


def compute_rs_divergence(log_ratio: torch.Tensor, divergence: str) -> torch.Tensor:
    """Per-token divergence of seed 001 from a (bounded) log ratio, shape preserved.

    k1: −log ρ (= log π_rollout − log π_old); k2: ½ (log ρ)²; k3: ρ − log ρ − 1 (Schulman 2020).
    """
    if divergence == "k1":
        return -log_ratio
    if divergence == "k2":
        return 0.5 * log_ratio.square()
    if divergence == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown divergence {divergence!r}; use 'k1', 'k2' or 'k3'")


def _aggregate(token_stat: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """(B,) per-sequence sum / mean / max of a (B, T) statistic over valid tokens (0 if empty)."""
    if aggregation == "seq_sum":
        return masked_sum(token_stat, mask, dim=-1)
    if aggregation == "seq_mean":
        return masked_mean(token_stat, mask, dim=-1)
    if aggregation == "seq_max":
        m = masked_max(token_stat, mask, dim=-1)
        return torch.where(mask.any(dim=-1), m, torch.zeros_like(m))
    raise ValueError(f"unknown aggregation {aggregation!r}")


def _keep(stat: torch.Tensor, option: RSOption) -> torch.Tensor:
    """Bool keep-mask: K1 ratio bounds are compared in log space, K2/K3 against the upper bound."""
    if option.divergence == "k1":
        assert option.lower is not None
        return (stat >= math.log(option.lower)) & (stat <= math.log(option.upper))
    return stat <= option.upper


def compute_rs_metrics(
    option: RSOption,
    token_stat: torch.Tensor,
    response_mask: torch.Tensor,
    seq_stat: torch.Tensor | None = None,
) -> dict[str, float]:
    """Distribution metrics of one RS criterion's statistic (verl key names, unprefixed).

    Args:
        option: the parsed criterion.
        token_stat: (B, T) statistic per token (the sequence statistic broadcast for seq modes).
        response_mask: (B, T) response mask.
        seq_stat: (B,) per-sequence statistic for seq modes (None for token modes: the per-sequence
            value is then the mean over the sequence's valid tokens).

    Returns keys ``rollout_rs_{mode}_`` + ``mean`` (token-weighted), ``max`` / ``min`` (over
    sequences for seq modes, tokens for token modes), ``fraction_high`` / ``fraction_low``
    (statistic above the upper / below the lower threshold — K1 in log units, lower only for K1),
    ``std`` (population std over tokens of the statistic clamped to the thresholds), ``seq_mean``,
    ``seq_std``, ``seq_max``, ``seq_min``, ``seq_max_deviation`` (max |·|), ``seq_fraction_high``
    and, for K1, ``seq_fraction_low``.
    """
    mask = as_bool_mask(response_mask)
    seq_valid = mask.any(dim=-1)
    stat = sanitize(token_stat.detach().to(torch.float64), mask)
    per_seq = (
        masked_mean(stat, mask, dim=-1) if seq_stat is None else seq_stat.detach().to(torch.float64)
    )
    is_k1 = option.divergence == "k1"
    hi = math.log(option.upper) if is_k1 else option.upper
    lo = math.log(option.lower) if (is_k1 and option.lower is not None) else 0.0
    p = f"rollout_rs_{option.name}"
    seq_level = not option.is_token_level
    m: dict[str, float] = {}

    m[f"{p}_mean"] = _f(masked_mean(stat, mask))
    if seq_level:
        m[f"{p}_max"] = _max_or_zero(per_seq, seq_valid)
        m[f"{p}_min"] = _min_or_zero(per_seq, seq_valid)
        m[f"{p}_fraction_high"] = _seq_mean((per_seq > hi).to(torch.float64), seq_valid)
        m[f"{p}_fraction_low"] = (
            _seq_mean((per_seq < lo).to(torch.float64), seq_valid) if is_k1 else 0.0
        )
    else:
        m[f"{p}_max"] = _max_or_zero(stat, mask)
        m[f"{p}_min"] = _min_or_zero(stat, mask)
        m[f"{p}_fraction_high"] = _f(masked_mean((stat > hi).to(torch.float64), mask))
        m[f"{p}_fraction_low"] = (
            _f(masked_mean((stat < lo).to(torch.float64), mask)) if is_k1 else 0.0
        )
    m[f"{p}_std"] = _masked_pop_std(stat.clamp(min=lo, max=hi), mask)
    m[f"{p}_seq_mean"] = _seq_mean(per_seq, seq_valid)
    m[f"{p}_seq_std"] = _seq_std(per_seq, seq_valid)
    m[f"{p}_seq_max"] = _max_or_zero(per_seq, seq_valid)
    m[f"{p}_seq_min"] = _min_or_zero(per_seq, seq_valid)
    m[f"{p}_seq_max_deviation"] = _max_or_zero(per_seq.abs(), seq_valid)
    m[f"{p}_seq_fraction_high"] = _seq_mean((per_seq > hi).to(torch.float64), seq_valid)
    if is_k1:
        m[f"{p}_seq_fraction_low"] = _seq_mean((per_seq < lo).to(torch.float64), seq_valid)
    return m


def _seq_any_rejected(keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) float: 1 where some valid token of the sequence is rejected."""
    return (mask & ~keep).any(dim=-1).to(torch.float64)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection-sampling mask from divergence criteria (seed 001 "Rejection sampling").

    Args:
        log_ratio: (B, T) log π_old − log π_rollout (clamped to ±20 here).
        response_mask: (B, T) response mask.
        rollout_rs: one of :data:`RS_MODES` or a comma-separated list; a token/sequence survives
            only if every criterion keeps it.
        rollout_rs_threshold: see :func:`parse_rs_options`.

    Per criterion, with d the token divergence (:func:`compute_rs_divergence`) and S its per-token
    value (``token_*``) or per-sequence sum / mean / max (``seq_*``) over valid tokens:
    K1 keeps lo ≤ exp(S) ≤ hi (i.e. log lo ≤ S ≤ log hi, S built from −log ρ = log π_rollout/π_old,
    as verl); K2/K3 keep S ≤ upper. Sequence criteria reject every token of the sequence.

    Returns:
        mask (B, T) bool: ``response_mask`` with rejected positions cleared.
        metrics: :func:`compute_rs_metrics` per criterion, ``rollout_rs_{mode}_masked_fraction``
            (fraction of valid tokens that criterion rejects),
            ``rollout_rs_{mode}_seq_masked_fraction`` (fraction of valid sequences with a rejected
            token), and the combined
            ``rollout_rs_masked_fraction`` / ``rollout_rs_seq_masked_fraction``.
    """
    options = parse_rs_options(rollout_rs, rollout_rs_threshold)
    mask = as_bool_mask(response_mask)
    seq_valid = mask.any(dim=-1)
    lr = clamped_log_ratio(log_ratio.detach(), torch.zeros_like(log_ratio), mask)
    keep_all = torch.ones_like(mask)
    metrics: dict[str, float] = {}
    for option in options:
        d = sanitize(compute_rs_divergence(lr, option.divergence), mask)
        if option.is_token_level:
            seq_stat = None
            token_stat = d
            keep = _keep(d, option)
        else:
            seq_stat = _aggregate(d, mask, option.aggregation)
            token_stat = seq_stat.unsqueeze(-1).expand_as(d)
            keep = _keep(seq_stat, option).unsqueeze(-1).expand_as(mask)
        keep = keep | ~mask  # padding is never "rejected"
        keep_all = keep_all & keep
        metrics.update(compute_rs_metrics(option, token_stat, mask, seq_stat))
        metrics[f"rollout_rs_{option.name}_masked_fraction"] = _f(
            masked_mean((~keep).to(torch.float64), mask)
        )
        metrics[f"rollout_rs_{option.name}_seq_masked_fraction"] = _seq_mean(
            _seq_any_rejected(keep, mask), seq_valid
        )
    metrics["rollout_rs_masked_fraction"] = _f(masked_mean((~keep_all).to(torch.float64), mask))
    metrics["rollout_rs_seq_masked_fraction"] = _seq_mean(
        _seq_any_rejected(keep_all, mask), seq_valid
    )
    return mask & keep_all, metrics


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights, rejection mask and diagnostics in one call (seed 001; verl's entry point).

    Args:
        old_log_prob: (B, T) log-probs of the sampled tokens under the training engine's policy
            (π_old in decoupled mode; in the ``bypass_mode`` loss pass the current log π_θ here).
        rollout_log_prob: (B, T) log-probs recorded by the rollout engine (π_rollout).
        response_mask: (B, T) response mask (bool or 0/1).
        config: the correction settings; None means :meth:`RolloutCorrectionConfig.disabled`.

    Returns:
        is_weights: (B, T) detached IS weights (0 at masked positions), or None when
            ``config.rollout_is`` is None. Computed on the original mask (RS does not change them).
        modified_response_mask: (B, T) bool, ``response_mask`` minus RS rejections (a copy of the
            mask when RS is off; IcePop never changes it — it zeroes weights).
        metrics: ``rollout_corr/``-prefixed floats: IS metrics (when IS is on), RS metrics (when RS
            is on) and the off-policy diagnostics (always). Nothing here carries gradient.
    """
    cfg = RolloutCorrectionConfig.disabled() if config is None else config
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
            f"{tuple(rollout_log_prob.shape)}, response_mask {tuple(response_mask.shape)}; "
            f"pass three (B, T) tensors"
        )
    mask = as_bool_mask(response_mask)
    old = sanitize(old_log_prob.detach(), mask)
    rollout = sanitize(rollout_log_prob.detach(), mask)
    log_ratio = clamped_log_ratio(old, rollout, mask)  # log ρ_t = clamp(old − rollout, ±20)
    metrics: dict[str, float] = {}

    weights: torch.Tensor | None = None
    if cfg.rollout_is is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio,
            mask,
            cfg.rollout_is,
            cfg.rollout_is_threshold,
            cfg.rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)

    modified_mask = mask.clone()
    if cfg.rollout_rs is not None:
        modified_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, mask, cfg.rollout_rs, cfg.rollout_rs_threshold
        )
        metrics.update(rs_metrics)

    metrics.update(compute_offpolicy_metrics(old, rollout, mask))
    return weights, modified_mask, {f"{METRIC_PREFIX}{k}": v for k, v in metrics.items()}


def apply_bypass_mode(
    old_log_prob: torch.Tensor | None,
    rollout_log_prob: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> torch.Tensor:
    """The log-probs to use as π_old for this batch.

    Bypass mode (seed 001 "Bypass vs decoupled mode") skips the training engine's recomputation of
    π_old and sets π_old := π_rollout, so the policy loss's ratio π_θ/π_old *is* the IS ratio
    π_θ/π_rollout. The rollout correction then belongs inside the ``bypass_mode`` policy loss,
    which calls ``compute_rollout_correction_and_rejection_mask(log_prob.detach(),
    rollout_log_prob, response_mask, config)`` with the current log π_θ: ``loss_type="ppo_clip"``
    uses only the RS mask (the clip already bounds the ratio; explicit weights would count it
    twice), ``"reinforce"`` also multiplies by the IS weights. A batch-level call with
    old == rollout would be a no-op (weights 1, nothing rejected).

    Args:
        old_log_prob: (B, T) recomputed log π_old, or None when it was not computed.
        rollout_log_prob: (B, T) log π_rollout from the inference engine.
        config: the correction settings.
    Returns:
        (B, T) ``rollout_log_prob`` (detached) in bypass mode, else ``old_log_prob``.
    """
    if config.bypass_mode:
        return rollout_log_prob.detach()
    if old_log_prob is None:
        raise ValueError(
            "decoupled mode (bypass_mode=False) needs old_log_prob recomputed by the training "
            "engine; compute it or use a bypass_* preset"
        )
    return old_log_prob
