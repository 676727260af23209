"""Differential test: our rollout correction against verl's reference implementation.

verl is NOT a dependency of this project; this module is skipped unless ``verl`` (and the modules
its ``rollout_corr_helper`` imports) can be imported. Inputs are deterministic (fixed seeds) and
have no all-padding sequence, because per-sequence averages deliberately differ there (we average
over sequences with a valid token; verl also averages empty rows — see the module docstring of
``training.algorithms.rollout_correction``).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from training.algorithms.rollout_correction import (
    METRIC_PREFIX,
    PRESETS,
    RS_MODES,
    RolloutCorrectionConfig,
    compute_rollout_correction_and_rejection_mask,
)

helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
verl_algorithm = pytest.importorskip("verl.trainer.config.algorithm")

ADDED_KEYS = {
    METRIC_PREFIX + k
    for k in (
        "rho_token_mean",
        "rho_token_p50",
        "rho_token_p90",
        "rho_token_p99",
        "rho_token_max",
        "rollout_is_p50",
        "rollout_is_p90",
        "rollout_is_p99",
    )
}
FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
)


def _batch(seed: int, scale: float, dtype: torch.dtype = torch.float64, b: int = 6, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    rollout = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 3).to(dtype)
    old = rollout + (scale * torch.randn(b, t, generator=g, dtype=torch.float64)).to(dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)  # right padding, no empty row
    return old, rollout, mask


def _compare(old, rollout, mask, cfg: RolloutCorrectionConfig, rel: float = 1e-6) -> None:
    w, new_mask, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, cfg)
    try:
        proto, v_mask, v_metrics = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=old,
            rollout_log_prob=rollout,
            response_mask=mask.to(old.dtype),
            rollout_is=cfg.rollout_is,
            rollout_is_threshold=cfg.rollout_is_threshold,
            rollout_is_batch_normalize=cfg.rollout_is_batch_normalize,
            rollout_rs=cfg.rollout_rs,
            rollout_rs_threshold=cfg.rollout_rs_threshold,
        )
    except ZeroDivisionError:
        # verl's ESS is 1 / mean(w̃²), which divides by zero when an IcePop band zeroes every
        # weight; we report ESS = 0 there (no sample carries weight).
        assert w is not None and not bool(w.any())
        assert metrics[METRIC_PREFIX + "rollout_is_eff_sample_size"] == 0.0
        return
    assert (w is None) == (proto is None)
    if w is not None:
        v_w = proto.batch["rollout_is_weights"]
        torch.testing.assert_close(w, v_w.to(w.dtype), rtol=rel, atol=1e-9)
    assert torch.equal(new_mask, v_mask.bool())
    expected_added = ADDED_KEYS if w is not None else {k for k in ADDED_KEYS if "rho" in k}
    assert set(metrics) - set(v_metrics) == expected_added
    assert set(v_metrics) <= set(metrics)
    for key, value in v_metrics.items():
        # The population stds (rollout_is_std, rollout_rs_*_std) are E[x²] − E[x]² in both; verl's
        # masked means divide by (n + 1e-8), which after the cancellation leaves an O(√(1e-8/n))
        # floor (e.g. 2e-5 for identical policies, whose true std is 0). Compare those loosely.
        loose = key.endswith("_std") and not key.endswith("_seq_std")
        tol = 1e-4 if loose else 1e-7
        assert metrics[key] == pytest.approx(value, rel=rel, abs=tol), key


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_equal_verl_presets(name: str) -> None:
    ours = PRESETS[name]()
    theirs = getattr(verl_algorithm.RolloutCorrectionConfig, name)()
    assert {f: getattr(ours, f) for f in FIELDS} == {f: getattr(theirs, f) for f in FIELDS}
    ours_sig = inspect.signature(PRESETS[name]).parameters
    theirs_sig = inspect.signature(getattr(verl_algorithm.RolloutCorrectionConfig, name)).parameters
    assert {k: p.default for k, p in ours_sig.items()} == {
        k: p.default for k, p in theirs_sig.items()
    }


def test_rs_modes_equal_verl() -> None:
    assert set(RS_MODES) == set(helper.SUPPORTED_ROLLOUT_RS_OPTIONS)
    assert helper.SAFETY_BOUND == 20.0


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("scale", [0.001, 0.01, 0.1, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_presets_match_verl(name: str, scale: float, seed: int) -> None:
    old, rollout, mask = _batch(seed, scale)
    _compare(old, rollout, mask, PRESETS[name]())


@pytest.mark.parametrize("mode", RS_MODES)
@pytest.mark.parametrize("scale", [0.01, 0.1, 0.5])
def test_each_rs_mode_matches_verl(mode: str, scale: float) -> None:
    old, rollout, mask = _batch(7, scale)
    for threshold in (
        ["0.99_1.01", "0.9_1.2", 1.5, "1.1"] if mode.endswith("k1") else [1e-3, 0.02, 0.5]
    ):
        cfg = RolloutCorrectionConfig(rollout_rs=mode, rollout_rs_threshold=threshold)
        _compare(old, rollout, mask, cfg)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.2, 2.0, 10.0, "0.5_5.0", "0.8_1.3"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_variants_match_verl(level: str, threshold, normalize: bool) -> None:
    for seed, scale in [(3, 0.05), (4, 0.3), (5, 1.0)]:
        old, rollout, mask = _batch(seed, scale)
        cfg = RolloutCorrectionConfig(
            rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize
        )
        _compare(old, rollout, mask, cfg)


def test_multi_mode_rs_matches_verl() -> None:
    old, rollout, mask = _batch(11, 0.2)
    for rs, thr in [
        ("token_k1,seq_mean_k3", "0.8_1.25,0.02"),
        ("seq_sum_k2, seq_max_k3,token_k3", "0.3"),
        (",".join(RS_MODES), "2.0"),
    ]:
        cfg = RolloutCorrectionConfig(
            rollout_is="token", rollout_is_threshold=2.0, rollout_rs=rs, rollout_rs_threshold=thr
        )
        _compare(old, rollout, mask, cfg)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_match_verl_float32(name: str) -> None:
    old, rollout, mask = _batch(21, 0.05, dtype=torch.float32)
    _compare(old, rollout, mask, PRESETS[name](), rel=1e-4)


def test_identical_policies_match_verl() -> None:
    _, rollout, mask = _batch(0, 0.0)
    for name in PRESETS:
        _compare(rollout.clone(), rollout, mask, PRESETS[name]())
    assert math.isfinite(
        sum(compute_rollout_correction_and_rejection_mask(rollout, rollout, mask)[2].values())
    )
