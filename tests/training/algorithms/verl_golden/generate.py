"""Regenerate ``rollout_correction.json``: verl's outputs on fixed inputs, as golden data.

The CI test ``tests/training/algorithms/test_rollout_correction_verl_golden.py`` replays these
cases through our ``training.algorithms.rollout_correction`` without verl installed. verl is never a
dependency of this project: this script is the only thing that imports it, and it is run by hand
in a throwaway environment where ``verl`` (and the modules its ``rollout_corr_helper`` pulls in at
import time) can be imported. The JSON it writes is data produced by verl; no verl code is stored.

Run from the repository root, in an environment with verl importable::

    python tests/training/algorithms/verl_golden/generate.py

The committed file was produced with verl 0.9.1 (wheel unpacked, CPU torch) in a scratch
environment whose ``/tmp/rcscratch/verl_import.py`` only stubs ``transformers``/``codetiming``
(imported by verl's package chain, unused by the rollout-correction math), with exactly::

    cd /work/main && PYTHONPATH=/tmp/rcscratch /tmp/verlenv/bin/python -c \
        "import verl_import, runpy; runpy.run_path( \
        'tests/training/algorithms/verl_golden/generate.py', run_name='__main__')"

Cases (all float64, batches of shape (5, 7), right padding, every row has ≥ 1 valid token, so the
documented all-padding-row difference never applies):

* every preset in our ``PRESETS`` on the ``near`` / ``moderate`` / ``large`` / ``identical``
  batches (our config's fields are what verl is called with), plus the two IcePop presets on the
  ``shifted`` batch, where every weight falls outside the band and verl raises ZeroDivisionError in
  its ESS (recorded as ``verl_error``);
* every mode in ``RS_MODES`` alone, with 2 thresholds each, on ``moderate`` and ``large``;
* token / sequence IS with batch normalisation (truncation and an IcePop band) on ``moderate`` and
  ``large``; and two multi-mode RS combinations.

Layout of the JSON: ``batches`` maps a batch name to its inputs (``old_log_prob``,
``rollout_log_prob``: float nested lists; ``response_mask``: 0/1 nested lists; plus the seed/scale/
shift that made them), stored once and shared by the cases that name them. Each entry of ``cases``
holds ``name``, ``kind`` (preset / rs_mode / is_batch_norm / rs_multi), ``preset`` (or null),
``batch``, ``config`` (all fields of our ``RolloutCorrectionConfig``; verl was called with its
``rollout_is*`` / ``rollout_rs*`` fields), and verl's ``is_weights`` (null when IS is off),
``modified_response_mask`` (0/1), ``metrics`` and ``verl_error`` (the exception type verl raised,
with the three outputs null, or null). Top level also records ``verl_version``, verl's RS mode
names, its log-ratio bound and, per preset, verl's preset fields and keyword defaults.

Inputs are rounded to 12 significant digits *before* verl sees them, so the stored inputs are
exactly what verl was run on; verl's outputs are rounded to 12 significant digits as well.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[3]
OUTPUT = HERE / "rollout_correction.json"
SIG_DIGITS = 12
B, T = 5, 7

# name → (seed, noise scale of log π_old − log π_rollout, constant shift of that difference)
BATCHES: dict[str, tuple[int, float, float]] = {
    "near": (0, 0.002, 0.0),  # the 0.999_1.001 geometric RS presets keep some, reject some
    "moderate": (6, 0.1, 0.0),
    "large": (7, 1.5, 0.0),  # large mismatch: token/sequence truncation and rejection fire
    "identical": (3, 0.0, 0.0),  # π_old == π_rollout: verl's std floor shows here
    "shifted": (4, 0.05, 3.0),  # ρ ≈ e³ ≈ 20 everywhere: outside the default IcePop band
}
PRESET_BATCHES = ("near", "moderate", "large", "identical")
ICEPOP_ONLY_BATCH = "shifted"
RS_BATCHES = ("moderate", "large")
# Two thresholds per RS mode: K1 modes take ratio bounds, K2/K3 modes an upper bound.
RS_THRESHOLDS_K1: tuple[float | str, ...] = ("0.9_1.2", 1.5)
RS_THRESHOLDS_K23: tuple[float | str, ...] = (0.02, 0.5)
IS_NORM_THRESHOLDS: tuple[float | str, ...] = (2.0, "0.5_5.0")
MULTI_RS: tuple[tuple[str, str], ...] = (
    ("token_k1,seq_mean_k3", "0.8_1.25,0.02"),
    ("seq_sum_k2,seq_max_k3,token_k3", "0.3"),
)


def _round(x: float) -> float:
    """Round to ``SIG_DIGITS`` significant digits (exactly representable in JSON)."""
    if not math.isfinite(x):
        raise ValueError(f"non-finite value {x!r} cannot be stored as golden data")
    return float(f"{x:.{SIG_DIGITS}g}")


def _rounded_list(t: torch.Tensor) -> list[list[float]]:
    return [[_round(float(v)) for v in row] for row in t.tolist()]


def make_batch(seed: int, scale: float, shift: float) -> dict[str, Any]:
    """Deterministic (B, T) float64 inputs, already rounded to ``SIG_DIGITS``."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = rollout + shift + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T  # at least one full-length row
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)  # right padding, no empty row
    return {
        "seed": seed,
        "scale": scale,
        "shift": shift,
        "old_log_prob": _rounded_list(old),
        "rollout_log_prob": _rounded_list(rollout),
        "response_mask": [[int(v) for v in row] for row in mask.tolist()],
    }


def run_verl(helper: Any, inputs: dict[str, Any], config: Any) -> dict[str, Any]:
    """Call verl on stored inputs; return its outputs (rounded) or the error it raised."""
    old = torch.tensor(inputs["old_log_prob"], dtype=torch.float64)
    rollout = torch.tensor(inputs["rollout_log_prob"], dtype=torch.float64)
    mask = torch.tensor(inputs["response_mask"], dtype=torch.float64)
    try:
        proto, new_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=old,
            rollout_log_prob=rollout,
            response_mask=mask,
            rollout_is=config.rollout_is,
            rollout_is_threshold=config.rollout_is_threshold,
            rollout_is_batch_normalize=config.rollout_is_batch_normalize,
            rollout_rs=config.rollout_rs,
            rollout_rs_threshold=config.rollout_rs_threshold,
        )
    except Exception as exc:  # recorded so the CI test can check the documented difference
        return {
            "verl_error": type(exc).__name__,
            "is_weights": None,
            "modified_response_mask": None,
            "metrics": None,
        }
    weights = None if proto is None else _rounded_list(proto.batch["rollout_is_weights"])
    return {
        "verl_error": None,
        "is_weights": weights,
        "modified_response_mask": [[int(bool(v)) for v in row] for row in new_mask.tolist()],
        "metrics": {k: _round(float(v)) for k, v in sorted(metrics.items())},
    }


def _config_fields(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def build() -> dict[str, Any]:
    """Run every case through verl and return the golden document."""
    sys.path.insert(0, str(REPO_ROOT))
    from verl.trainer.config import algorithm as verl_algorithm
    from verl.trainer.ppo import rollout_corr_helper as helper

    from training.algorithms.rollout_correction import (
        PRESETS,
        RS_MODES,
        RolloutCorrectionConfig,
    )

    verl_cfg = verl_algorithm.RolloutCorrectionConfig
    batches = {name: make_batch(*spec) for name, spec in BATCHES.items()}
    cases: list[dict[str, Any]] = []

    def add(name: str, kind: str, batch: str, config: Any, preset: str | None = None) -> None:
        cases.append(
            {
                "name": name,
                "kind": kind,
                "preset": preset,
                "batch": batch,
                "config": _config_fields(config),
                **run_verl(helper, batches[batch], config),
            }
        )

    for preset, ctor in PRESETS.items():
        config = ctor()
        batch_names = list(PRESET_BATCHES)
        if config.uses_icepop:
            batch_names.append(ICEPOP_ONLY_BATCH)
        for batch in batch_names:
            add(f"preset/{preset}/{batch}", "preset", batch, config, preset=preset)

    for mode in RS_MODES:
        thresholds = RS_THRESHOLDS_K1 if mode.endswith("k1") else RS_THRESHOLDS_K23
        for threshold in thresholds:
            config = RolloutCorrectionConfig(rollout_rs=mode, rollout_rs_threshold=threshold)
            for batch in RS_BATCHES:
                add(f"rs/{mode}/{threshold}/{batch}", "rs_mode", batch, config)

    for level in ("token", "sequence"):
        for threshold in IS_NORM_THRESHOLDS:
            config = RolloutCorrectionConfig(
                rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=True
            )
            for batch in RS_BATCHES:
                add(f"is_batch_norm/{level}/{threshold}/{batch}", "is_batch_norm", batch, config)

    for rs, threshold in MULTI_RS:
        config = RolloutCorrectionConfig(
            rollout_is="token",
            rollout_is_threshold=2.0,
            rollout_rs=rs,
            rollout_rs_threshold=threshold,
        )
        add(f"rs_multi/{rs}/{threshold}/large", "rs_multi", "large", config)

    verl_presets = {
        name: {
            "fields": _config_fields(getattr(verl_cfg, name)()),
            "defaults": {
                k: p.default
                for k, p in inspect.signature(getattr(verl_cfg, name)).parameters.items()
            },
        }
        for name in PRESETS
    }
    return {
        "about": (
            "Golden outputs of verl's compute_rollout_correction_and_rejection_mask (data only). "
            "Regenerate with tests/training/algorithms/verl_golden/generate.py; replayed by "
            "tests/training/algorithms/test_rollout_correction_verl_golden.py."
        ),
        "verl_version": importlib.metadata.version("verl"),
        "torch_version": torch.__version__,
        "dtype": "float64",
        "significant_digits": SIG_DIGITS,
        "verl_rs_modes": sorted(helper.SUPPORTED_ROLLOUT_RS_OPTIONS),
        "verl_safety_bound": float(helper.SAFETY_BOUND),
        "verl_presets": verl_presets,
        "batches": batches,
        "cases": cases,
    }


def dumps(doc: dict[str, Any]) -> str:
    """Compact JSON with one batch / one case per line (small file, readable diffs)."""

    def enc(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)

    parts = []
    for key, value in doc.items():
        if key == "batches":
            body = ",\n".join(f"  {enc(k)}:{enc(v)}" for k, v in value.items())
            parts.append(f"{enc(key)}:{{\n{body}\n}}")
        elif key == "cases":
            body = ",\n".join(f"  {enc(c)}" for c in value)
            parts.append(f"{enc(key)}:[\n{body}\n]")
        else:
            parts.append(f"{enc(key)}:{enc(value)}")
    text = "{\n" + ",\n".join(parts) + "\n}\n"
    assert json.loads(text) == doc
    return text


def main() -> None:
    doc = build()
    OUTPUT.write_text(dumps(doc))
    errors = sum(c["verl_error"] is not None for c in doc["cases"])
    size_kb = OUTPUT.stat().st_size / 1024
    print(f"wrote {OUTPUT} ({len(doc['cases'])} cases, {errors} verl errors, {size_kb:.0f} KB)")


if __name__ == "__main__":
    main()
