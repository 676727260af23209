"""``predict(recipe, calibration) -> Prediction``: the step time and speed-up a recipe's async knobs
would give on a calibrated set-up (information only — never a gate).

Three runs of :func:`training.sim.model.simulate` on the same response lengths: the knobs' mode on
the rollout / train split, ``sync`` on the same split (the overlap limit comes from its phases)
and the colocated ``sync`` baseline (one step = ``trigger_parameter_sync_step × require_batches ×
batch_prompts × n`` responses, seed 002's fair comparison, on every device). Step times are per
such step. ``t0`` of the generation model is fitted first so that a reference batch generated at
once on ``generation.devices`` takes ``generation.time_s``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from training.sim.calibration import Calibration, Knobs
from training.sim.model import Pipeline, SimResult, simulate

if TYPE_CHECKING:
    from training.recipe import Recipe

__all__ = ["Prediction", "knobs_from_recipe", "predict", "predict_knobs"]


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one set of knobs on one calibration."""

    mode: str
    step_time_s: float  # per step of trigger_parameter_sync_step trainer steps
    sync_step_time_s: float  # sync on the same rollout / train split
    colocated_step_time_s: float  # colocated sync on every device
    speedup: float  # colocated_step_time_s / step_time_s
    speedup_over_sync: float  # sync_step_time_s / step_time_s
    overlap_limit: float  # (T_gen + T_train) / max(T_gen, T_train) of the sync run
    efficiency: float  # speedup_over_sync / overlap_limit
    total_time_s: float  # the recipe's steps
    trainer_idle_ratio: float
    rollout_idle_ratio: float
    mean_staleness: float  # weight syncs between submission and training, per response
    cores_demanded: float | None  # while generation and training both run (CPU set-ups)
    contention_factor: float  # speed each phase keeps while both run (1 = no contention)
    explanation: str
    knobs: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def knobs_from_recipe(recipe: Recipe, base: Knobs | None = None) -> Knobs:
    """The recipe's async knobs (``colocated`` is kept from ``base``: a recipe has no such
    field, and it applies to sync only)."""
    a = recipe.async_
    data: dict[str, Any] = {
        "mode": a.mode, "require_batches": a.require_batches,
        "max_ahead_steps": a.max_ahead_steps, "batch_prompts": recipe.rollout.batch_prompts,
        "n": recipe.rollout.n, "steps": recipe.steps,
        "colocated": bool(base and base.colocated and a.mode == "sync"),
    }
    if a.mode == "fully_async":
        data.update(staleness_threshold=a.staleness_threshold,
                    trigger_parameter_sync_step=a.trigger_parameter_sync_step,
                    partial_rollout=a.partial_rollout)
    return Knobs(**data)


def _lockstep(k: Knobs) -> tuple[float, int, bool, bool]:
    """(θ, K, partial_rollout, lockstep) the mode means (training.recipe's _Lockstep)."""
    if k.mode == "sync":
        return 0.0, 1, False, True
    if k.mode == "one_step":
        return 1.0, 1, False, True
    return k.staleness_threshold, k.trigger_parameter_sync_step, k.partial_rollout, False


@dataclass(frozen=True)
class _Setup:
    """One calibration resolved for one run size (simulated scale ``scale``)."""

    cal: Calibration
    scale: float  # real responses per simulated response
    t0: float

    def pipeline(self, k: Knobs, steps: int, *, colocated: bool, mode_knobs: Knobs) -> Pipeline:
        c, d = self.cal, self.cal.devices
        theta, K, partial, lockstep = _lockstep(mode_knobs)
        B_real = mode_knobs.samples_per_step
        gpu = d.kind == "gpu"
        gen_dev = d.total if (colocated and gpu) else d.rollout
        train_dev = d.total if colocated else d.train
        tr = c.train
        update, measured_on = tr.update_time_s, tr.devices
        if not colocated and tr.separate_update_time_s is not None:
            update, measured_on = tr.separate_update_time_s, tr.separate_devices or d.train
        other = tr.other_time_s
        if not colocated and tr.separate_other_time_s is not None:
            other = tr.separate_other_time_s
        per_sample = update + other + (tr.old_logprob_time_s if colocated else 0.0)
        per_sample /= tr.batch_samples
        if gpu:
            per_sample *= (measured_on / train_dev) ** tr.scaling_exponent
        cap = c.generation.max_running_per_device
        engine_cores = d.cores if (colocated and not gpu and d.cores) else d.engine_cores
        train_cores = d.cores if (colocated and not gpu and d.cores) else d.train_cores
        return Pipeline(
            steps=steps, samples_per_step=max(1, round(B_real / self.scale)), sync_interval=K,
            quota_threshold=theta, partial_rollout=partial, lockstep=lockstep,
            max_ahead_steps=mode_knobs.max_ahead_steps, t0=self.t0,
            knee=gen_dev * c.generation.load_knee / self.scale,
            max_running=None if cap is None else max(1, round(gen_dev * cap / self.scale)),
            train_cost_per_sample=per_sample * self.scale, sync_s=c.sync.time_s,
            mean_tokens=c.lengths.mean_tokens, sigma=c.lengths.sigma,
            max_tokens=c.lengths.max_tokens, seed=c.sim.seed, cores=d.cores,
            engine_cores=engine_cores, train_cores=train_cores,
            overhead_cores=d.overhead_cores, extra_core_efficiency=d.extra_core_efficiency,
            shared_speed=d.shared_speed if d.cores is not None else 1.0)


def _fit_t0(cal: Calibration) -> float:
    """t0 such that a reference batch generated at once on ``generation.devices`` takes
    ``generation.time_s`` (generation time is linear in t0: one run at t0 = 1 suffices)."""
    g = cal.generation
    scale = max(1.0, g.batch_samples / cal.sim.max_samples_per_step)
    steps = 8
    cap = g.max_running_per_device
    probe = Pipeline(
        steps=steps, samples_per_step=max(1, round(g.batch_samples / scale)), sync_interval=1,
        quota_threshold=0.0, partial_rollout=False, lockstep=True, max_ahead_steps=None,
        t0=1.0, knee=g.devices * g.load_knee / scale,
        max_running=None if cap is None else max(1, round(g.devices * cap / scale)),
        train_cost_per_sample=0.0, sync_s=0.0, mean_tokens=cal.lengths.mean_tokens,
        sigma=cal.lengths.sigma, max_tokens=cal.lengths.max_tokens, seed=cal.sim.seed)
    res = simulate(probe)
    return g.time_s / (res.gen_wait_s / steps)


def predict(recipe: Recipe | None, calibration: Calibration) -> Prediction:
    """Predict ``recipe``'s step time and speed-up on ``calibration`` (the calibration's own
    knobs when ``recipe`` is None). Deterministic: the lengths come from ``calibration.sim.seed``.
    """
    if recipe is None:
        if calibration.knobs is None:
            raise ValueError(f"calibration {calibration.name!r} carries no knobs; pass a recipe")
        return predict_knobs(calibration.knobs, calibration)
    return predict_knobs(knobs_from_recipe(recipe, calibration.knobs), calibration)


def predict_knobs(knobs: Knobs, calibration: Calibration) -> Prediction:
    """:func:`predict` for explicit :class:`~training.sim.calibration.Knobs`."""
    cal = calibration
    _theta, K, _, _ = _lockstep(knobs)
    B = knobs.samples_per_step
    step_samples = K * B  # one step of the colocated baseline
    scale = max(1.0, step_samples / cal.sim.max_samples_per_step)
    setup = _Setup(cal, scale, _fit_t0(cal))
    steps = knobs.steps
    if steps > cal.sim.max_steps:
        steps = K * math.ceil(cal.sim.max_steps / K)
    cycles = max(1, steps // K)
    sync_knobs = knobs.model_copy(update={"mode": "sync", "colocated": False,
                                          "require_batches": knobs.require_batches * K,
                                          "steps": cycles})
    run = simulate(setup.pipeline(knobs, steps, colocated=knobs.colocated, mode_knobs=knobs))
    sync = simulate(setup.pipeline(sync_knobs, cycles, colocated=False, mode_knobs=sync_knobs))
    col = simulate(setup.pipeline(sync_knobs, cycles, colocated=True, mode_knobs=sync_knobs))

    def per_step(r: SimResult) -> float:
        return r.time_per_sample * step_samples / scale

    step, sync_step, col_step = per_step(run), per_step(sync), per_step(col)
    t_gen, t_train = sync.gen_wait_s, sync.train_s + sync.sync_s
    limit = (t_gen + t_train) / max(t_gen, t_train, 1e-12)
    speedup_over_sync = sync_step / step
    d = cal.devices
    demanded = None
    if d.cores is not None and not knobs.colocated:
        demanded = d.engine_cores + d.overhead_cores + d.train_cores
    pred = dict(
        mode=knobs.mode + (" (colocated)" if knobs.colocated else ""),
        step_time_s=step, sync_step_time_s=sync_step, colocated_step_time_s=col_step,
        speedup=col_step / step, speedup_over_sync=speedup_over_sync, overlap_limit=limit,
        efficiency=speedup_over_sync / limit,
        total_time_s=step * knobs.steps / K,
        trainer_idle_ratio=(run.gen_wait_s + run.sync_s) / run.wall_s,
        rollout_idle_ratio=run.rollout_idle_ratio, mean_staleness=run.mean_staleness,
        cores_demanded=demanded, contention_factor=run.contention_factor,
        knobs=knobs.model_dump())
    return Prediction(explanation=_explain(pred, run, cal, knobs), **pred)


def _explain(p: dict[str, Any], run: SimResult, cal: Calibration, knobs: Knobs) -> str:
    d = cal.devices
    where = (f"all {d.total} devices (colocated)" if knobs.colocated
             else f"{d.rollout} rollout + {d.train} train devices")
    parts = [f"{p['mode']} on {where}: {p['step_time_s']:.4g} s per step vs colocated sync "
             f"{p['colocated_step_time_s']:.4g} s ({p['speedup']:.2f}x) and sync on the split "
             f"{p['sync_step_time_s']:.4g} s ({p['speedup_over_sync']:.2f}x)."]
    t_idle, r_idle = p["trainer_idle_ratio"], p["rollout_idle_ratio"]
    if knobs.mode != "sync":
        bound = ("generation bounds the pipeline (the trainer waits)" if t_idle > r_idle
                 else "training bounds the pipeline (the engines wait)")
        parts.append(f"Trainer idle {t_idle:.0%}, engines idle {r_idle:.0%}: {bound}.")
        if p["efficiency"] <= 1.0:
            parts.append(f"Overlap limit {p['overlap_limit']:.2f}x, efficiency "
                         f"{p['efficiency']:.2f}.")
        else:  # streaming and partial rollout also cut the long tail's wait, which overlap
            # alone cannot: the speed-up goes past what overlapping the two phases gives
            parts.append(f"Beyond the overlap limit {p['overlap_limit']:.2f}x "
                         f"({p['efficiency']:.2f} of it): streaming and partial rollout also "
                         "remove the batch's wait for its longest responses.")
    if p["cores_demanded"] is not None and d.cores is not None:
        demand, cores = p["cores_demanded"], d.cores
        if demand > cores:
            parts.append(
                f"CPU contention: engine {d.engine_cores:g} + trainer {d.train_cores:g} + "
                f"rollouter/driver/buffer {d.overhead_cores:g} = {demand:g} cores demanded on "
                f"{cores:g}, so while both phases run each keeps {cores / demand:.2f} of its "
                f"speed (overlapped {run.overlap_s / run.wall_s:.0%} of the wall): the "
                "overlap saves less than the limit promises.")
        else:
            parts.append(f"No CPU contention: {demand:g} cores demanded on {cores:g}.")
    return " ".join(parts)
