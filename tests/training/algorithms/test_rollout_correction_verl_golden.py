"""Differential test against verl's rollout correction through stored golden data (no verl needed).

``verl_golden/rollout_correction.json`` holds verl's outputs of
``compute_rollout_correction_and_rejection_mask`` on fixed float64 inputs (see
``verl_golden/generate.py`` for how it was made and the command to regenerate it). Here each case is
replayed through our implementation and compared with the same tolerances and the same documented
exceptions as ``test_verl_parity.py`` (which runs against a live verl where one is installed):

* our extra tail metrics (``ADDED_KEYS``) are the only keys verl lacks;
* ``rollout_is_std`` / ``rollout_rs_*_std`` compare loosely (verl's (n + 1e-8) denominators leave a
  ~1e-5 floor after the E[x²] − E[x]² cancellation);
* where verl raises ZeroDivisionError (ESS when an IcePop band zeroes every weight) we must return
  all-zero weights and ESS = 0.

No batch has an all-padding row, so the documented per-sequence averaging difference never applies.
The coverage tests below keep the fixture from silently losing presets, RS modes or cases.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from training.algorithms.masked import LOG_RATIO_BOUND
from training.algorithms.rollout_correction import (
    METRIC_PREFIX,
    PRESETS,
    RS_MODES,
    RolloutCorrectionConfig,
    compute_rollout_correction_and_rejection_mask,
)

GOLDEN_PATH = Path(__file__).parent / "verl_golden" / "rollout_correction.json"
GOLDEN: dict[str, Any] = json.loads(GOLDEN_PATH.read_text())
CASES: list[dict[str, Any]] = GOLDEN["cases"]
BATCHES: dict[str, dict[str, Any]] = GOLDEN["batches"]

PRESET_BATCHES = {"near", "moderate", "large", "identical"}
RS_BATCHES = {"moderate", "large"}
KNOWN_VERL_ERRORS = {"ZeroDivisionError"}

# Metrics we report that verl does not (tails asked for by the package conventions).
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
# Config fields shared with verl's RolloutCorrectionConfig.
FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
)


def _inputs(batch: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data = BATCHES[batch]
    old = torch.tensor(data["old_log_prob"], dtype=torch.float64)
    rollout = torch.tensor(data["rollout_log_prob"], dtype=torch.float64)
    mask = torch.tensor(data["response_mask"], dtype=torch.bool)
    return old, rollout, mask


# ---- the fixture itself --------------------------------------------------------------------


def test_fixture_metadata_and_inputs() -> None:
    assert GOLDEN["verl_version"]
    assert GOLDEN["dtype"] == "float64"
    assert len({c["name"] for c in CASES}) == len(CASES)
    assert {c["batch"] for c in CASES} <= set(BATCHES)
    for name, data in BATCHES.items():
        old, rollout, mask = _inputs(name)
        assert old.shape == rollout.shape == mask.shape == (5, 7), name
        assert torch.isfinite(old).all() and torch.isfinite(rollout).all(), name
        lengths = mask.sum(dim=1)
        assert bool((lengths >= 1).all()), f"{name}: all-padding row"
        right_padded = torch.arange(mask.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        assert torch.equal(mask, right_padded), f"{name}: not right padded"
        assert set(data) >= {"old_log_prob", "rollout_log_prob", "response_mask"}
    assert torch.equal(*_inputs("identical")[:2])


def test_fixture_covers_every_preset() -> None:
    batches_per_preset: dict[str, set[str]] = defaultdict(set)
    for case in CASES:
        if case["kind"] == "preset":
            batches_per_preset[case["preset"]].add(case["batch"])
    assert set(batches_per_preset) == set(PRESETS)
    for name, batches in batches_per_preset.items():
        assert batches >= PRESET_BATCHES, name


def test_fixture_covers_every_rs_mode_with_two_thresholds() -> None:
    thresholds: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for case in CASES:
        if case["kind"] == "rs_mode":
            cfg = case["config"]
            assert cfg["rollout_is"] is None
            thresholds[cfg["rollout_rs"]].add((repr(cfg["rollout_rs_threshold"]), case["batch"]))
    assert set(thresholds) == set(RS_MODES)
    for mode, seen in thresholds.items():
        assert len({t for t, _ in seen}) >= 2, mode
        for threshold in {t for t, _ in seen}:
            assert {b for t, b in seen if t == threshold} >= RS_BATCHES, (mode, threshold)


def test_fixture_covers_batch_normalised_is() -> None:
    seen = {
        (c["config"]["rollout_is"], isinstance(c["config"]["rollout_is_threshold"], str))
        for c in CASES
        if c["config"]["rollout_is_batch_normalize"]
    }
    # token and sequence level, each with truncation (float) and an IcePop band ("lo_hi")
    assert seen >= {("token", False), ("token", True), ("sequence", False), ("sequence", True)}


def test_fixture_exercises_truncation_and_rejection() -> None:
    ok = [c for c in CASES if c["verl_error"] is None]
    truncated = {
        c["config"]["rollout_is"]
        for c in ok
        if c["is_weights"] is not None
        and not c["config"]["rollout_is_batch_normalize"]
        and isinstance(c["config"]["rollout_is_threshold"], float)
        and c["metrics"][METRIC_PREFIX + "rollout_is_ratio_fraction_high"] > 0
    }
    assert truncated == {"token", "sequence"}
    partly_rejected = [
        c
        for c in ok
        if c["kind"] == "rs_mode"
        and 0 < c["metrics"][METRIC_PREFIX + "rollout_rs_seq_masked_fraction"] < 1
    ]
    assert len(partly_rejected) >= len(RS_MODES)
    assert {c["verl_error"] for c in CASES} - {None} <= KNOWN_VERL_ERRORS


# ---- verl's presets and constants (recorded by the generator) ------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_equal_verl_presets(name: str) -> None:
    theirs = GOLDEN["verl_presets"][name]
    ours = PRESETS[name]()
    assert {f: getattr(ours, f) for f in FIELDS} == {f: theirs["fields"][f] for f in FIELDS}
    ours_defaults = {k: p.default for k, p in inspect.signature(PRESETS[name]).parameters.items()}
    assert ours_defaults == theirs["defaults"]


def test_rs_modes_and_bound_equal_verl() -> None:
    assert set(RS_MODES) == set(GOLDEN["verl_rs_modes"])
    assert GOLDEN["verl_safety_bound"] == LOG_RATIO_BOUND == 20.0


# ---- the differential check ----------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_verl_golden(case: dict[str, Any]) -> None:
    cfg = RolloutCorrectionConfig(**case["config"])
    if case["kind"] == "preset":
        # the stored config is what verl was run with; it must still be our preset
        assert cfg == PRESETS[case["preset"]](), "preset changed: regenerate the golden data"
    old, rollout, mask = _inputs(case["batch"])
    w, new_mask, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, cfg)

    if case["verl_error"] is not None:
        assert case["verl_error"] in KNOWN_VERL_ERRORS, case["verl_error"]
        # verl's ESS is 1 / mean(w̃²), which divides by zero when an IcePop band zeroes every
        # weight; we report ESS = 0 there (no sample carries weight).
        assert w is not None and not bool(w.any())
        assert metrics[METRIC_PREFIX + "rollout_is_eff_sample_size"] == 0.0
        return

    rel = 1e-6
    assert (w is None) == (case["is_weights"] is None)
    if w is not None:
        v_w = torch.tensor(case["is_weights"], dtype=torch.float64)
        torch.testing.assert_close(w, v_w, rtol=rel, atol=1e-9)
    v_mask = torch.tensor(case["modified_response_mask"], dtype=torch.bool)
    assert torch.equal(new_mask, v_mask)

    v_metrics: dict[str, float] = case["metrics"]
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


def test_config_fields_round_trip() -> None:
    field_names = {f.name for f in dataclasses.fields(RolloutCorrectionConfig)}
    for case in CASES:
        assert set(case["config"]) == field_names, case["name"]
