"""Throughput of the off-policy correction pass on CPU, float32.

Usage:
    python benchmarks/algorithms.py                 # 1M tokens (1024 sequences × 1024 tokens)
    python benchmarks/algorithms.py --batch 256 --length 512 --repeats 5

Prints, side by side, tokens/s of each stage and of the full pass a decoupled train step runs
before its backward: CompIS per-source weights (staleness cap + engine IcePop), the seed-001
rollout correction (preset decoupled_geo_rs_token_tis: token TIS + seq_mean_k1 RS, with verl's
metrics), the diagnostics (mismatch/train_rollout/*, mismatch/engine/*, is/*, M2PO
percentiles), and the CompIS PPO loss forward +
backward. Inputs are seeded and identical each run; ~30% of positions are padding, with NaN
written there to exercise the masked paths. Times are the median of ``--repeats`` runs after one
warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

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


def make_batch(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, length, generator=g) * 3.0
    old = rollout + 0.02 * torch.randn(batch, length, generator=g)          # engine mismatch
    prox = old + 0.05 * torch.randn(batch, length, generator=g)             # staleness
    cur = prox + 0.01 * torch.randn(batch, length, generator=g)
    lengths = torch.randint(length // 3, length + 1, (batch,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(batch, 1, generator=g).expand(batch, length).contiguous()
    nan = torch.tensor(float("nan"))
    return {k: torch.where(mask, v, nan) for k, v in
            {"rollout": rollout, "old": old, "prox": prox, "cur": cur, "adv": adv}.items()} | {
        "mask": mask}


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    b = make_batch(args.batch, args.length)
    n_tokens = args.batch * args.length
    rc = RolloutCorrectionConfig.decoupled_geo_rs_token_tis()
    compis = CompISConfig(engine=SourceCorrection("icepop"))  # both sources corrected

    def stage_compis():
        compute_compis_weights(b["prox"], b["old"], b["rollout"], b["mask"], compis)

    def stage_rollout_correction():
        compute_rollout_correction_and_rejection_mask(b["old"], b["rollout"], b["mask"], rc)

    def stage_diagnostics():
        compute_off_policy_diagnostics(b["prox"], b["old"], b["rollout"], b["mask"])

    def stage_loss():
        cur = b["cur"].clone().requires_grad_(True)
        loss, _ = compis_policy_loss(cur, b["prox"], b["old"], b["rollout"], b["adv"], b["mask"],
                                     compis)
        loss.backward()

    def full_pass():
        stage_rollout_correction()
        stage_diagnostics()  # includes the CompIS weights and their metrics
        stage_loss()

    stages = [("CompIS weights", stage_compis), ("rollout correction", stage_rollout_correction),
              ("diagnostics", stage_diagnostics), ("CompIS loss fwd+bwd", stage_loss),
              ("full pass", full_pass)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, float32, "
          f"B×T = {args.batch}×{args.length} = {n_tokens:,} tokens "
          f"({int(b['mask'].sum()):,} valid), median of {args.repeats}")
    print(f"{'stage':<22}{'seconds':>10}{'Mtokens/s':>12}")
    for name, fn in stages:
        sec = timed(fn, args.repeats)
        print(f"{name:<22}{sec:>10.3f}{n_tokens / sec / 1e6:>12.2f}")


if __name__ == "__main__":
    main()
