"""Rollout-correction math on CPU, float32: asyncrl side by side with verl 0.9.1 on the same inputs.

Usage:
    python benchmarks/algorithms.py                         # 256 × 4096 slots, 1 thread
    python benchmarks/algorithms.py --repeats 9 --verl-path /work/scratch-verl/site
    python benchmarks/algorithms.py --batch 64 --length 1024 --no-extra

Rows (issue 16, "Correction math"): the presets ``decoupled_token_is``,
``decoupled_geo_rs_token_tis``, ``decoupled_k3_rs_seq_tis`` and ``decoupled_token_icepop`` through
``compute_rollout_correction_and_rejection_mask`` (ours built from our ``RolloutCorrectionConfig``
presets, verl's called with the fields of verl's own presets), and ``compute_offpolicy_metrics``.
Both sides get the same tensors: float32 log-probs, a float32 0/1 response mask, zeros at padding
(verl multiplies by the mask, so NaN padding would poison its outputs). Lengths are drawn so that
~0.54 M of the 1 M slots are valid, as in the issue. Each row's time is the median of
``--repeats`` runs after one warm-up, ours and verl's interleaved so that load from other
processes hits both alike. The table's last column is verl's time ÷ ours (≥ 1: we are at least as
fast); the last line is the worst such ratio, the figure the target is about. Every verl row also
checks that the metrics verl and we both report agree (largest relative difference shown, with its
key: verl's float32 sums and its (n + 1e-8) denominators leave ~1e-4 in ``log_ppl_diff`` and the
population stds; we accumulate in float64, see ``training.algorithms.rollout_correction``).

verl is never a dependency of this project. It is imported only when ``--verl-path`` (a folder
with ``verl`` and the few modules its ``rollout_corr_helper`` imports, e.g. a ``pip install
--target DIR --no-deps`` of verl==0.9.1, tensordict, pyvers, omegaconf, codetiming) makes it
importable; otherwise the table has our times alone and says so.

Further rows, ours only (``--no-extra`` skips them): CompIS per-source weights (staleness cap +
engine IcePop), the off-policy diagnostics (``mismatch/*``, ``is/*``, M2PO percentiles) and the
CompIS PPO loss forward + backward, on a NaN-padded copy of the same batch.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from training.algorithms import (
    CompISConfig,
    RolloutCorrectionConfig,
    SourceCorrection,
    compis_policy_loss,
    compute_compis_weights,
    compute_off_policy_diagnostics,
    compute_rollout_correction_and_rejection_mask,
)
from training.algorithms.rollout_correction import compute_offpolicy_metrics

DEFAULT_VERL_PATH = "/work/scratch-verl/site"
PRESET_ROWS = (
    "decoupled_token_is",
    "decoupled_geo_rs_token_tis",
    "decoupled_k3_rs_seq_tis",
    "decoupled_token_icepop",
)
# The fields verl's compute_rollout_correction_and_rejection_mask takes from its config.
VERL_FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
)


def make_batch(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 log-probs (B, T) of three policies, a float 0/1 mask, advantages.

    Lengths are uniform in [T/32, T] (≈ 0.52 T valid per row on average); padding holds 0.
    """
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, length, generator=g) * 3.0
    old = rollout + 0.02 * torch.randn(batch, length, generator=g)  # engine mismatch
    prox = old + 0.05 * torch.randn(batch, length, generator=g)  # staleness
    cur = prox + 0.01 * torch.randn(batch, length, generator=g)
    lengths = torch.randint(max(1, length // 32), length + 1, (batch,), generator=g)
    valid = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(batch, 1, generator=g).expand(batch, length).contiguous()
    zero = torch.zeros(())
    out = {k: torch.where(valid, v, zero) for k, v in
           {"rollout": rollout, "old": old, "prox": prox, "cur": cur, "adv": adv}.items()}
    out["mask"] = valid.to(torch.float32)
    return out


def load_verl(path: str) -> tuple[ModuleType | None, ModuleType | None, str]:
    """verl's rollout_corr_helper and config module from ``path``, or (None, None, why not)."""
    if not Path(path).is_dir():
        return None, None, f"no folder {path}"
    sys.path.insert(0, path)
    try:
        helper = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
        config = importlib.import_module("verl.trainer.config.algorithm")
        version = importlib.import_module("verl").__version__
    except ImportError as exc:  # a partial scratch install: report it, time ours alone
        return None, None, f"verl not importable from {path}: {exc}"
    return helper, config, f"verl {version} from {path}"


def timed_pair(ours: Callable[[], Any], theirs: Callable[[], Any] | None,
               repeats: int) -> tuple[float, float | None]:
    """Median seconds of each callable over ``repeats`` interleaved runs after one warm-up."""
    ours()
    if theirs is not None:
        theirs()
    t_ours: list[float] = []
    t_theirs: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ours()
        t_ours.append(time.perf_counter() - t0)
        if theirs is not None:
            t0 = time.perf_counter()
            theirs()
            t_theirs.append(time.perf_counter() - t0)
    return statistics.median(t_ours), (statistics.median(t_theirs) if t_theirs else None)


def max_rel_diff(ours: dict[str, float], theirs: dict[str, Any]) -> tuple[int, float, str]:
    """(shared keys, largest |a − b| / max(|b|, 1e-6), its key) over the metrics both report."""
    shared = sorted(set(ours) & set(theirs))
    worst, worst_key = 0.0, ""
    for key in shared:
        a, b = float(ours[key]), float(theirs[key])
        diff = 0.0 if a == b else abs(a - b) / max(abs(b), 1e-6)
        if math.isnan(diff) or diff > worst:
            worst, worst_key = diff, key
    return len(shared), worst, worst_key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    parser.add_argument("--verl-path", default=DEFAULT_VERL_PATH,
                        help="folder from which verl 0.9.1 and its imports can be loaded")
    parser.add_argument("--no-extra", action="store_true",
                        help="skip the CompIS / diagnostics / loss rows (ours only)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    b = make_batch(args.batch, args.length)
    old, rollout, mask = b["old"], b["rollout"], b["mask"]
    helper, verl_config, verl_note = load_verl(args.verl_path)

    def verl_preset(kwargs: dict[str, Any]) -> Callable[[], Any]:
        return lambda: helper.compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, **kwargs)

    rows: list[tuple[str, Callable[[], Any], Callable[[], Any] | None]] = []
    for name in PRESET_ROWS:
        ours_cfg = getattr(RolloutCorrectionConfig, name)()
        theirs_fn = None
        if helper is not None and verl_config is not None:
            theirs_cfg = getattr(verl_config.RolloutCorrectionConfig, name)()
            kwargs = {f: getattr(theirs_cfg, f) for f in VERL_FIELDS}
            assert kwargs == {f: getattr(ours_cfg, f) for f in VERL_FIELDS}, (name, kwargs)
            theirs_fn = verl_preset(kwargs)
        rows.append((name, lambda c=ours_cfg: compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, c), theirs_fn))
    rows.append(("compute_offpolicy_metrics",
                 lambda: compute_offpolicy_metrics(old, rollout, mask),
                 (lambda: helper.compute_offpolicy_metrics(old, rollout, mask))
                 if helper is not None else None))

    n_valid = int(mask.sum())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, float32, "
          f"B×T = {args.batch}×{args.length} = {args.batch * args.length:,} slots "
          f"({n_valid:,} valid), median of {args.repeats} after a warm-up")
    print(verl_note if helper is not None else f"{verl_note}: our times alone")
    print(f"{'row':<30}{'asyncrl ms':>12}{'verl ms':>10}{'verl/asyncrl':>14}"
          f"{'metrics':>9}{'max rel diff':>14}  (key)")
    ratios: list[tuple[float, str]] = []
    for name, ours_fn, theirs_fn in rows:
        t_ours, t_theirs = timed_pair(ours_fn, theirs_fn, args.repeats)
        if t_theirs is None:
            print(f"{name:<30}{t_ours * 1e3:>12.1f}{'—':>10}{'—':>14}")
            continue
        ours_metrics, theirs_metrics = ours_fn(), theirs_fn()
        if isinstance(ours_metrics, tuple):
            ours_metrics, theirs_metrics = ours_metrics[-1], theirs_metrics[-1]
        shared, worst, worst_key = max_rel_diff(ours_metrics, theirs_metrics)
        ratio = t_theirs / t_ours
        ratios.append((ratio, name))
        print(f"{name:<30}{t_ours * 1e3:>12.1f}{t_theirs * 1e3:>10.1f}{ratio:>14.2f}"
              f"{shared:>9}{worst:>14.1e}  ({worst_key.removeprefix('rollout_corr/')})")

    if not args.no_extra:
        nan = torch.tensor(float("nan"))
        valid = mask.bool()
        nb = {k: torch.where(valid, b[k], nan) for k in ("rollout", "old", "prox", "cur", "adv")}
        compis = CompISConfig(engine=SourceCorrection("icepop"))  # both sources corrected

        def stage_loss() -> None:
            cur = nb["cur"].clone().requires_grad_(True)
            loss, _ = compis_policy_loss(cur, nb["prox"], nb["old"], nb["rollout"], nb["adv"],
                                         valid, compis)
            loss.backward()

        extra = [
            ("CompIS weights", lambda: compute_compis_weights(
                nb["prox"], nb["old"], nb["rollout"], valid, compis)),
            ("off-policy diagnostics", lambda: compute_off_policy_diagnostics(
                nb["prox"], nb["old"], nb["rollout"], valid)),
            ("CompIS loss fwd+bwd", stage_loss),
        ]
        for name, fn in extra:
            t_ours, _ = timed_pair(fn, None, args.repeats)
            print(f"{name:<30}{t_ours * 1e3:>12.1f}{'—':>10}{'—':>14}")

    if ratios:
        worst_ratio, worst_name = min(ratios)
        print(f"worst verl/asyncrl ratio: {worst_ratio:.2f} ({worst_name}); target ≥ 1.00")
    else:
        print("worst verl/asyncrl ratio: n/a (verl not importable)")


if __name__ == "__main__":
    main()
