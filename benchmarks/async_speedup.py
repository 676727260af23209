"""Async speed-up: the same number of samples in sync, one_step and fully_async (partial rollout).

Runs one recipe three times on local Ray with the embedded engines — only ``async.mode`` differs —
with one rollout engine (1 thread) and the trainer (1 thread), i.e. one core each on a 2-core
machine (seed 002's resource isolation), on the long-tail task (sum_digits with most prompts easy
and a few long ones, so a batch waits for its slowest responses) and prints, side by side:

- wall time of the training loop (engines and actors already up; no eval),
- phase times: generation wait (trainer idle), training, weight sync,
- the trainer's and rollouter's idle ratios and the mean staleness,
- ``sync_2thr``: sync again with the engine and the trainer given every core (2 threads each
  on a 2-core machine: they take turns, so neither leaves a core idle while the other works) —
  the async gain at equal cores is fully_async's speed-up over this row,
- the speed-up over sync, and the overlap limit computed from the sync run's own phases,
  (T_gen + T_train) / max(T_gen, T_train) — the most that overlapping two phases can give — so
  the efficiency (speed-up ÷ limit) is visible.

    python benchmarks/async_speedup.py            # 12 steps × 64 samples per mode (~3-5 min)
    python benchmarks/async_speedup.py --quick    # 4 steps × 32 samples

The warm start is cached under $ASYNCRL_HOME (the first run trains it, ~3 min). Times on a shared
2-core machine vary by ±20%; compare the columns of one run, on an otherwise idle machine.

Measured 2026-11-26 (2 cores, idle, defaults): sync loop 13.0 s (T_gen 6.2 s, T_train 6.5 s →
overlap limit 1.95×), sync_2thr 12.9 s, one_step 11.8 s (1.11×, efficiency 0.57), fully_async
11.5 s (1.13×, 0.58; 1.13× over sync_2thr). What is left on the table: the two cores are full
(engine and trainer one core each; the rollouter actor, the driver and the sample buffer about
0.4 core more), so generation slows while the trainer works.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.recipe import recipe_from_dict
from training.runtime.run import run_recipe
from training.runtime.sinks import read_metrics

MODES = {
    "sync": {"mode": "sync"},
    "sync_2thr": {"mode": "sync"},
    "one_step": {"mode": "one_step"},
    "fully_async": {"mode": "fully_async", "staleness_threshold": 0.5,
                    "trigger_parameter_sync_step": 1, "partial_rollout": True,
                    "max_off_policy_steps": 4},
}
# sync given both cores: generation and training take turns, so each may use every core
ALL_CORES = ("sync_2thr",)


def recipe_for(mode: str, steps: int, prompts: int, n: int, engines: int) -> object:
    threads = (os.cpu_count() or 1) if mode in ALL_CORES else 1
    return recipe_from_dict({
        "name": f"speedup-{mode}", "steps": steps,
        "task": {"name": "sum_digits", "difficulty_weights": {1: 4, 2: 4, 3: 2, 6: 1, 8: 1}},
        "rollout": {"n": n, "batch_prompts": prompts, "max_response_tokens": 32},
        "engines": {"num_rollout_engines": engines, "rollout_threads": threads,
                    "train_threads": threads},
        "async": MODES[mode],
        "data": {"drain": "windowed_fifo", "window": 2 * prompts, "dispatch": "length_aware"},
        "algorithm": {"old_logprob": "snapshot", "correction": {"kind": "compis"}},
        "eval": {"every": 0, "n": 0},
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--engines", type=int, default=1, help=(
        "rollout servers (1 thread each); the trainer uses 1 thread. Default 1: on a 2-core "
        "machine that gives the rollouter and the trainer one core each — seed 002's resource "
        "isolation. With 2 engines, generation alone fills both cores and overlapping it with "
        "training only adds contention."))
    ap.add_argument("--quick", action="store_true", help="4 steps × 4 prompts × 8")
    ap.add_argument("--out", type=Path, default=None, help="keep the run dirs here")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.prompts = 4, 4
    import ray

    from training.ray_setup import init_ray

    init_ray(num_cpus=2)
    out = args.out or Path(tempfile.mkdtemp(prefix="asyncrl-speedup-"))
    rows = {}
    try:
        for mode in MODES:
            recipe = recipe_for(mode, args.steps, args.prompts, args.n, args.engines)
            t0 = time.monotonic()
            res = run_recipe(recipe, out=out / mode, checkpoint_every=0)
            total = time.monotonic() - t0
            m = [r for r in read_metrics(res.metrics_path) if not r.get("step/eval_only")]
            s = res.summary
            rows[mode] = {
                "wall": s["run/wall_time_s"], "total": total,
                "gen_wait": s["run/wait_time_s"], "train": s["run/train_time_s"],
                "sync": s["run/sync_time_s"], "samples": s["run/trained_samples"],
                "dropped": s["run/dropped_stale_samples"],
                "trainer_idle": m[-1]["async/trainer_idle_ratio"],
                "rollouter_idle": m[-1]["async/rollouter_idle_ratio"],
                "staleness": sum(r["async/staleness/mean"] for r in m) / len(m),
                "partial": sum(r["async/partial_ratio"] for r in m) / len(m),
                "reward": sum(r["rollout/reward_mean"] for r in m) / len(m),
            }
            print(f"  {mode}: {total:.1f} s total (loop {s['run/wall_time_s']:.1f} s)",
                  flush=True)
    finally:
        ray.shutdown()
    base = rows["sync"]
    t_gen, t_train = base["gen_wait"], base["train"] + base["sync"]
    limit = (t_gen + t_train) / max(t_gen, t_train)
    samples = args.steps * args.prompts * args.n
    print(f"\nasync speed-up — {samples} samples per mode ({args.steps} steps × {args.prompts} "
          f"prompts × {args.n}), long-tail sum_digits, {args.engines} rollout engine(s) × 1 "
          f"thread + trainer × 1 thread, {os.cpu_count()} cores, local Ray")
    print(f"sync phases: T_gen {t_gen:.2f} s, T_train {t_train:.2f} s (train "
          f"{base['train']:.2f} + sync {base['sync']:.2f}) → overlap limit "
          f"(T_gen+T_train)/max = {limit:.2f}×\n")
    hdr = (f"{'mode':<12}{'loop s':>8}{'gen wait':>10}{'train':>8}{'sync':>7}{'tr idle':>9}"
           f"{'ro idle':>9}{'stale':>7}{'partial':>9}{'dropped':>9}{'reward':>8}{'speed-up':>10}"
           f"{'effic.':>8}")
    print(hdr)
    print("-" * len(hdr))
    for mode, r in rows.items():
        speed = base["wall"] / r["wall"]
        print(f"{mode:<12}{r['wall']:>8.2f}{r['gen_wait']:>10.2f}{r['train']:>8.2f}"
              f"{r['sync']:>7.2f}{r['trainer_idle']:>9.2f}{r['rollouter_idle']:>9.2f}"
              f"{r['staleness']:>7.2f}{r['partial']:>9.2f}{r['dropped']:>9.0f}{r['reward']:>8.3f}"
              f"{speed:>9.2f}×{speed / limit:>8.2f}")
    cores = rows["sync_2thr"]["wall"]
    print(f"\nsync_2thr: sync with the rollout engine and the trainer given {os.cpu_count()} "
          f"threads each (they take turns).")
    print(f"efficiency (speed-up over sync ÷ overlap limit {limit:.2f}×): one_step "
          f"{base['wall'] / rows['one_step']['wall'] / limit:.2f}, fully_async "
          f"{base['wall'] / rows['fully_async']['wall'] / limit:.2f} (target ≥ 0.9)")
    print(f"fully_async over sync with all cores: {cores / rows['fully_async']['wall']:.2f}× "
          f"(target ≥ 1.0)")
    print(f"\nrun directories: {out}")


if __name__ == "__main__":
    main()
