"""Old-log-prob strategies side by side: memory for old weights, step time, how exact π_old is.

Runs one short fully-async recipe (partial rollouts, staleness up to 2 trainer steps) once per
``algorithm.old_logprob`` strategy on local Ray with the embedded engines — only the strategy
differs, plus ``engines.snapshot_budget_mb``, which is 0 except under ``snapshot`` (the trainer
would otherwise keep snapshots it never reads) — and prints one row per strategy:

- ``held``: parameter copies kept for old policies beside the trainer's live weights
  (``old/held_bytes``: retained snapshots and the shadow model that runs them, the EWMA
  reference, the dedicated old-logit model; plus, under ``interrupt``, the rollouter's copy of
  the served weights, ``async/old_logit_held_bytes``), in KiB and in copies of the model;
- ``step_s``: mean trainer step time in the trainer actor (``async/trainer_step_time_s``, steps
  after the first) and ``old_s``, the dedicated model's share (``old/dedicated_s``) or, under
  ``interrupt``, the rollouter's π_old forwards per step (``async/old_logit_s`` over the run
  / steps; they run beside training, not in the step);
- ``stall``: ``interrupt`` only, the mean time each weight sync stalls generation for π_old
  (``async/old_logit_interrupt_s``: waiting for the aborted tokens, their forward, loading the
  copy), beside the sync's own load (``async/weight_sync_s``);
- ``exact``: the share of loss tokens whose π_old is the trainer at the token's own behaviour
  version (``old/exact_frac``), and the dedicated model's fallback share;
- ``|π_old−exact|``: mean |π_old − μ| (``mismatch/engine/logprob_abs_diff/mean``). The rollout
  numerics are fp32, where μ is the trainer's own log-prob at the behaviour version to ≤ 2e-4
  (tests/training/runtime/test_partial_rollout.py), so this is the distance of each strategy's
  π_old from the exact one. Under the default bf16 rollouts μ carries the engine mismatch too, so
  the strategies whose π_old is μ (loglinear, linear_prox, bypass) would carry all of it.

    python benchmarks/old_logprob.py                      # 8 steps × 8 prompts × 4 (~1 min)
    python benchmarks/old_logprob.py --quick              # 4 steps
    python benchmarks/old_logprob.py --strategies snapshot --rollout-dtype bf16   # engine gap
    python benchmarks/old_logprob.py --strategies interrupt                        # one row

The model is a small warm start (2 layers, d = 64, 600 supervised steps; built once under
$ASYNCRL_HOME, ~4 min on 2 cores): the tests' 60-step one gets every sum wrong, so its groups
carry no gradient and no weight version differs from the next. The learning rate is 2e-4, not the
recipes' 3e-5, for the same reason: in 8 steps the versions must differ for π_old to matter.
Times on a shared 2-core machine vary by ±20%; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.recipe import OLD_LOGPROB_STRATEGIES, Recipe, recipe_from_dict
from training.runtime.run import run_recipe
from training.runtime.sinks import read_metrics


def recipe_for(strategy: str, steps: int, prompts: int, n: int, lr: float,
               rollout_dtype: str) -> Recipe:
    return recipe_from_dict({
        "name": f"old-{strategy}", "steps": steps,
        "model": {"kind": "warmstart", "warmstart_steps": 600, "hidden_size": 64,
                  "num_layers": 2},
        # sums the small warm start gets partly wrong: groups with mixed rewards, so every
        # step moves the weights and old versions differ from the current one
        "task": {"name": "sum_digits", "difficulty_weights": {2: 1, 3: 1}},
        "rollout": {"n": n, "batch_prompts": prompts, "max_response_tokens": 24,
                    "temperature": 1.2},
        "optim": {"lr": lr},
        "engines": {"num_rollout_engines": 1, "rollout_dtype": rollout_dtype,
                    "snapshot_budget_mb": 256 if strategy == "snapshot" else 0},
        "async": {"mode": "fully_async", "staleness_threshold": 1.0, "partial_rollout": True,
                  "max_off_policy_steps": 2},
        "data": {"drain": "fifo"},
        "algorithm": {"old_logprob": strategy, "correction": {"kind": "none"}},
        "eval": {"every": 0, "n": 0},
    })


def _mean(rows: list[dict], key: str) -> float:
    values = [float(r[key]) for r in rows if key in r]
    return sum(values) / len(values) if values else float("nan")


def measure(strategy: str, steps: int, prompts: int, n: int, lr: float, rollout_dtype: str,
            out: Path) -> dict[str, float]:
    recipe = recipe_for(strategy, steps, prompts, n, lr, rollout_dtype)
    t0 = time.monotonic()
    res = run_recipe(recipe, out=out / strategy, checkpoint_every=0)
    rows = [r for r in read_metrics(res.metrics_path) if not r.get("step/eval_only")]
    from training.engines.hf_io import load_hf_dir

    last = sorted((res.run_dir / "weights").glob("v*"), key=lambda p: int(p.name[1:]))[-1]
    model_bytes = sum(p.numel() * p.element_size()
                      for p in load_hf_dir(last).model.parameters())
    held = _mean(rows, "old/held_bytes")
    old_s = _mean(rows[1:], "old/dedicated_s")
    fallback = _mean(rows, "old/dedicated_fallback_frac")
    if strategy == "interrupt":
        held += _mean(rows, "async/old_logit_held_bytes")
        old_s = float(rows[-1]["async/old_logit_s"]) / len(rows)
        fallback = _mean(rows, "old/interrupt_fallback_frac")
    return {
        "held": held, "copies": held / model_bytes,
        "step_s": _mean(rows[1:], "async/trainer_step_time_s"),
        "old_s": old_s, "exact": _mean(rows, "old/exact_frac"), "fallback": fallback,
        "stall": _mean(rows, "async/old_logit_interrupt_s"),
        "sync": _mean(rows, "async/weight_sync_s"),
        "diff": _mean(rows, "mismatch/engine/logprob_abs_diff/mean"),
        "staleness": _mean(rows, "async/staleness/mean"),
        "partial": _mean(rows, "async/partial_ratio"), "wall": time.monotonic() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--lr", type=float, default=2e-4, help=(
        "learning rate (the recipes' 3e-5 barely moves the tiny model in a few steps)"))
    ap.add_argument("--strategies", nargs="*", default=list(OLD_LOGPROB_STRATEGIES))
    ap.add_argument("--rollout-dtype", default="fp32", choices=("fp32", "bf16", "fp8"), help=(
        "embedded rollout numerics; fp32 makes μ the exact π_old (the last column's premise), "
        "bf16 shows the engine gap under snapshot"))
    ap.add_argument("--quick", action="store_true", help="4 steps")
    ap.add_argument("--out", type=Path, default=None, help="keep the run dirs here")
    args = ap.parse_args()
    if args.quick:
        args.steps = 4
    import ray

    from training.ray_setup import init_ray

    init_ray(num_cpus=2)
    out = args.out or Path(tempfile.mkdtemp(prefix="asyncrl-old-logprob-"))
    rows = {}
    try:
        for strategy in args.strategies:
            rows[strategy] = measure(strategy, args.steps, args.prompts, args.n, args.lr,
                                     args.rollout_dtype, out)
            print(f"  {strategy}: {rows[strategy]['wall']:.1f} s", flush=True)
    finally:
        ray.shutdown()
    print(f"\n{args.steps} steps × {args.prompts} prompts × {args.n}, fully_async (partial "
          f"rollouts, max_off_policy_steps 2), {args.rollout_dtype} rollouts, lr {args.lr:g}, "
          "correction none\n")
    print(f"{'strategy':<12} {'held KiB':>9} {'copies':>6} {'step_s':>7} {'old_s':>6} "
          f"{'exact':>6} {'fallbk':>6} {'|π_old−exact|':>13} {'stale':>6} {'partial':>7} "
          f"{'stall':>6} {'sync_s':>6}")
    for strategy, r in rows.items():
        old_s, fallback, stall = ("-" if r[k] != r[k] else f"{r[k]:.3f}"
                                  for k in ("old_s", "fallback", "stall"))
        print(f"{strategy:<12} {r['held'] / 1024:>9.1f} {r['copies']:>6.2f} {r['step_s']:>7.3f} "
              f"{old_s:>6} {r['exact']:>6.3f} {fallback:>6} {r['diff']:>13.2e} "
              f"{r['staleness']:>6.2f} {r['partial']:>7.2f} {stall:>6} {r['sync']:>6.3f}")


if __name__ == "__main__":
    main()
