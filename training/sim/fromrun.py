"""A calibration from a finished run directory (``asyncrl simulate --from-run RUN_DIR -o FILE``).

What it reads: ``recipe.yaml`` (the knobs, the batch, the engines) and ``metrics.jsonl`` (one
record per trainer step; eval-only records skipped). Per reference batch (one trainer step):

- generation ``time_s``: a sync run's mean ``async/wait_time_s`` (the trainer waits exactly while
  the batch is generated); any other mode's busy engine time per step,
  ``(1 − async/rollouter_idle_ratio) · async/wall_time_s / steps`` (the last record's),
- train ``update_time_s``: mean ``async/train_time_s``; sync ``time_s``: mean
  ``async/weight_sync_s + async/weight_export_s``,
- lengths: ``mean_tokens`` the mean ``rollout/response_length/mean``, σ from the median and p90
  (``ln(p90 / p50) / 1.2816``), ``max_tokens`` the recipe's ``max_response_tokens``,
- devices: embedded engines are CPU processes sharing this machine's cores (``os.cpu_count()``
  when the calibration is written — run it where the run ran); ``overhead_cores`` 0.4 and
  ``extra_core_efficiency`` 0 are this machine's figures (docs/findings/async-speedup.md), edit
  them for another machine. GPU back-ends give a GPU calibration with the recipe's split.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from statistics import mean
from typing import Any

from training.sim.calibration import CalibrationError, calibration_from_dict
from training.sim.predict import knobs_from_recipe

__all__ = ["calibration_from_run"]


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return mean(vals) if vals else None


def calibration_from_run(run_dir: str | Path) -> dict[str, Any]:
    """The calibration (plain data, validated) of the run in ``run_dir``; CalibrationError (one
    line) when it is not a finished run directory."""
    from training.recipe import RecipeError, load_recipe
    from training.runtime.sinks import read_metrics

    d = Path(run_dir)
    if not d.is_dir():
        raise CalibrationError(f"{d} is not a directory; pass a run directory written by "
                               "asyncrl train")
    for name in ("recipe.yaml", "metrics.jsonl"):
        if not (d / name).is_file():
            raise CalibrationError(f"{d} has no {name}; pass a run directory written by "
                                   "asyncrl train")
    try:
        recipe = load_recipe(d / "recipe.yaml")
        rows = [r for r in read_metrics(d / "metrics.jsonl") if not r.get("step/eval_only")]
    except (RecipeError, ValueError) as e:
        raise CalibrationError(str(e)) from None
    rows = [r for r in rows if isinstance(r.get("async/train_time_s"), int | float)]
    if not rows:
        raise CalibrationError(f"{d}/metrics.jsonl has no trainer step; let the run finish a "
                               "step first")
    steps = len(rows)
    if recipe.mode == "sync":
        gen = _mean(rows, "async/wait_time_s") or 0.0
    else:
        last = rows[-1]
        gen = ((1.0 - float(last.get("async/rollouter_idle_ratio", 0.0)))
               * float(last.get("async/wall_time_s", 0.0)) / steps)
    sync = sum(_mean(rows, k) or 0.0 for k in ("async/weight_sync_s", "async/weight_export_s"))
    p50 = _mean(rows, "rollout/response_length/p50")
    p90 = _mean(rows, "rollout/response_length/p90")
    sigma = math.log(p90 / p50) / 1.2816 if p50 and p90 and p90 > p50 else 0.5
    length = _mean(rows, "rollout/response_length/mean") or float(
        recipe.rollout.max_response_tokens) / 2
    e = recipe.engines
    batch = recipe.rollout.batch_prompts * recipe.rollout.n * recipe.async_.require_batches
    if e.rollout == "embedded" and e.train == "embedded":
        cores = float(os.cpu_count() or 1)
        devices: dict[str, Any] = {
            "kind": "cpu", "total": max(1, int(cores)), "rollout": e.num_rollout_engines,
            "train": 1, "cores": cores,
            "engine_cores": float(e.num_rollout_engines * e.rollout_threads),
            "train_cores": float(e.train_threads), "overhead_cores": 0.4,
            "extra_core_efficiency": 0.0}
        knee, gen_devices = 8.0, e.num_rollout_engines
    else:
        m = e.megatron
        train_dev = m.tensor_parallel * m.pipeline_parallel * m.data_parallel
        devices = {"kind": "gpu", "total": e.num_rollout_engines + train_dev,
                   "rollout": e.num_rollout_engines, "train": train_dev}
        knee, gen_devices = 64.0, e.num_rollout_engines
    data = {
        "name": f"run-{recipe.name.replace('/', '-')}",
        "description": f"Written from {d} ({steps} trainer steps, mode {recipe.mode}).",
        "devices": devices,
        "lengths": {"mean_tokens": max(1.0, length), "sigma": min(3.0, max(0.0, sigma)),
                    "max_tokens": float(recipe.rollout.max_response_tokens)},
        "generation": {"time_s": max(gen, 1e-6), "devices": gen_devices,
                       "batch_samples": batch, "load_knee": knee,
                       "max_running_per_device": e.max_batch},
        "train": {"update_time_s": _mean(rows, "async/train_time_s") or 0.0,
                  "devices": devices["train"], "batch_samples": batch},
        "sync": {"time_s": sync},
        "knobs": knobs_from_recipe(recipe).model_dump(),
    }
    calibration_from_dict(data, f"calibration of {d}")  # what is written loads back
    return data
