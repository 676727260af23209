"""Masked reductions shared by every algorithm in this package.

Notation (used by every module of ``training.algorithms``):
    B  batch size (sequences), T  response length (padded), mask  (B, T) response mask.

Contract: a value at a masked position (mask == 0) never influences any output, whatever it is —
including NaN and ±inf. Every function here therefore *selects* with ``torch.where`` instead of
multiplying by the mask (``NaN * 0`` is NaN), and public algorithm functions start by passing their
inputs through :func:`sanitize` so that gradients at masked positions are exactly zero too.
"""

from __future__ import annotations

import math

import torch

# log-space safety bound for every importance ratio (seed 001: "All computations happen in log-space
# with a safety bound of ±20 (since e^20 ≈ 4.85e8)").
LOG_RATIO_BOUND = 20.0

TAIL_QUANTILES = (0.5, 0.9, 0.99)


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a bool tensor (accepts bool, int or float 0/1 masks)."""
    return mask if mask.dtype == torch.bool else mask != 0


def sanitize(values: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Replace values at masked positions by ``fill`` (removes NaN/inf garbage there).

    Gradients flow to valid positions only; masked positions receive an exact zero gradient.
    """
    return torch.where(as_bool_mask(mask), values, torch.full_like(values, fill))


def clamped_log_ratio(
    numerator_log_probs: torch.Tensor,
    denominator_log_probs: torch.Tensor,
    mask: torch.Tensor,
    bound: float = LOG_RATIO_BOUND,
) -> torch.Tensor:
    """log(numerator / denominator), clamped to ±``bound``, zero at masked positions.

    Args:
        numerator_log_probs: (B, T) log-probs of the sampled tokens under the numerator policy.
        denominator_log_probs: (B, T) log-probs under the denominator policy.
        mask: (B, T) response mask.
    Returns:
        (B, T) clamped log-ratio; 0 where mask == 0.
    """
    diff = sanitize(numerator_log_probs, mask) - sanitize(denominator_log_probs, mask)
    return sanitize(torch.clamp(diff, min=-bound, max=bound), mask)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` (B, T) over valid positions: a scalar, or per ``dim`` (e.g. (B,))."""
    v = sanitize(values, mask)
    return v.sum() if dim is None else v.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    m = as_bool_mask(mask)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid positions; 0 where there is no valid position."""
    count = masked_count(mask, dim).to(values.dtype)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid positions (Bessel-corrected when ``unbiased`` and n > 1)."""
    values = sanitize(values, mask)
    mean = masked_mean(values, mask)
    sq = masked_sum((values - mean) ** 2, mask)
    n = masked_count(mask).to(values.dtype)
    denom = (n - 1) if unbiased else n
    return sq / denom.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over valid positions; masked positions are returned as 0."""
    values = sanitize(values, mask)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return sanitize(out, mask)


def masked_max(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Max of ``values`` (B, T) over valid positions (scalar or per ``dim``); -inf if none."""
    v = sanitize(values, mask, fill=-math.inf)
    return v.max() if dim is None else v.max(dim=dim).values


def masked_min(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Min of ``values`` (B, T) over valid positions (scalar or per ``dim``); +inf if none."""
    v = sanitize(values, mask, fill=math.inf)
    return v.min() if dim is None else v.min(dim=dim).values


def valid_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1-D tensor of the values at valid positions (detached)."""
    return values.detach()[as_bool_mask(mask)]


def tail_stats(values: torch.Tensor, mask: torch.Tensor | None = None, prefix: str = "",
               quantiles: tuple[float, ...] = TAIL_QUANTILES) -> dict[str, float]:
    """Mean, p50/p90/p99 and max of ``values`` over valid positions, as floats.

    Seed 000: "always check the tails, not just the mean". Returns keys ``{prefix}mean``,
    ``{prefix}p50``, ``{prefix}p90``, ``{prefix}p99``, ``{prefix}max``. With no valid value
    every statistic is 0.0 (an empty batch has no tail).
    """
    flat = values.detach().reshape(-1) if mask is None else valid_values(values, mask)
    flat = flat.to(torch.float64)
    out: dict[str, float] = {}
    if flat.numel() == 0:
        out[f"{prefix}mean"] = 0.0
        for q in quantiles:
            out[f"{prefix}p{round(q * 100)}"] = 0.0
        out[f"{prefix}max"] = 0.0
        return out
    out[f"{prefix}mean"] = flat.mean().item()
    for q, v in zip(quantiles, sorted_quantiles(flat, quantiles), strict=True):
        out[f"{prefix}p{round(q * 100)}"] = v
    out[f"{prefix}max"] = flat.max().item()
    return out


def sorted_quantiles(flat: torch.Tensor, quantiles: tuple[float, ...]) -> list[float]:
    """Quantiles of a non-empty 1-D tensor with linear interpolation (as ``torch.quantile``),
    by one sort, so it works beyond ``torch.quantile``'s 2**24-element limit."""
    ordered = torch.sort(flat).values
    n = ordered.numel()
    out = []
    for q in quantiles:
        pos = q * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        frac = pos - lo
        out.append((ordered[lo] + (ordered[hi] - ordered[lo]) * frac).item())
    return out


def sequence_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B,) bool: sequences that have at least one valid token."""
    return as_bool_mask(mask).any(dim=-1)


def to_float(x: torch.Tensor | float) -> float:
    return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)
