"""The simulator's calibration file: measured (or published) phase times, the resource split, the
response-length distribution and, optionally, the async knobs and the figures to reproduce.

A calibration is YAML validated by :class:`Calibration` (every field bounded and described, the
file read by :func:`training.yamlfile.read_yaml`, every problem one :class:`CalibrationError`
line). ``benchmarks/sim/`` ships two: seed 002's 128-GPU set-up and this machine's embedded runs;
:func:`training.sim.fromrun.calibration_from_run` writes one from a finished run directory.

Phase times are *uncontended* times of one reference batch (``*.batch_samples`` samples): the
generation time is the wall time of generating the whole batch at once, long tail included (the
sync loop's trainer wait), as seed 002's tables report ``gen``.

This module imports pydantic and yaml only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from training.yamlfile import (
    YamlBool,
    YamlFloat,
    YamlInt,
    YamlOptFloat,
    YamlOptInt,
    format_validation_error,
    read_yaml,
    require_mapping,
)

__all__ = [
    "Calibration",
    "CalibrationError",
    "Knobs",
    "calibration_from_dict",
    "load_calibration",
]

_HINT = "see docs/simulator.md for the calibration fields"


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the field and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              allow_inf_nan=False)


class Devices(_Strict):
    """The resource split and, for CPU set-ups, the cores the phases share."""

    kind: Literal["gpu", "cpu"] = Field("gpu", description=(
        "gpu: devices are accelerators; a colocated sync gives every device to each phase and "
        "phase times scale with the device count. cpu: devices are engine processes / trainer "
        "threads on a fixed number of `cores`; a colocated sync gives each phase every core "
        "and speed comes from the core model."))
    total: YamlInt = Field(..., ge=1, le=1_000_000, description=(
        "Devices of the whole set-up; a colocated sync uses all of them for each phase."))
    rollout: YamlInt = Field(..., ge=1, le=1_000_000, description=(
        "Devices (GPUs, or CPU engine processes) generating when rollout and training are "
        "separate (one_step, fully_async, sync not colocated)."))
    train: YamlInt = Field(..., ge=1, le=1_000_000, description=(
        "Devices training when rollout and training are separate."))
    cores: YamlOptFloat = Field(None, gt=0.0, le=100_000.0, description=(
        "CPU cores the phases share (CPU contention). None: phases never slow each other (GPU "
        "set-ups with separate devices)."))
    engine_cores: YamlFloat = Field(1.0, ge=0.0, le=100_000.0, description=(
        "Cores a generating rollout engine demands (its threads) when separate."))
    train_cores: YamlFloat = Field(1.0, ge=0.0, le=100_000.0, description=(
        "Cores a training step demands (its threads) when separate."))
    overhead_cores: YamlFloat = Field(0.0, ge=0.0, le=100_000.0, description=(
        "Cores the rollouter actor, driver and sample buffer demand while generation runs."))
    extra_core_efficiency: YamlFloat = Field(1.0, ge=0.0, le=1.0, description=(
        "Speed a phase gains per core beyond its first (1 = linear, 0 = extra threads give "
        "nothing): how a colocated CPU sync, where each phase takes every core, is timed."))
    shared_speed: YamlFloat = Field(1.0, gt=0.0, le=1.0, description=(
        "Speed each phase keeps while the other runs, over and above the core count (shared "
        "caches, memory bandwidth, actor event loops): 1 = none. Measure it as a phase's time "
        "alone ÷ its time beside the other phase ÷ min(1, cores / demand)."))

    @model_validator(mode="after")
    def _split(self) -> Devices:
        if self.kind == "gpu" and self.rollout + self.train > self.total:
            raise ValueError(f"rollout {self.rollout} + train {self.train} devices exceed total "
                             f"{self.total}; lower the split or raise total")
        return self


class Lengths(_Strict):
    """Response lengths (tokens): a log-normal with a cap, the long tail of RL rollouts."""

    mean_tokens: YamlFloat = Field(..., gt=0.0, le=10_000_000.0, description=(
        "Mean of the uncapped log-normal (tokens)."))
    sigma: YamlFloat = Field(1.0, ge=0.0, le=5.0, description=(
        "Log-normal shape σ: 0 = every response the same length; ~1 = a long tail."))
    max_tokens: YamlFloat = Field(..., gt=0.0, le=10_000_000.0, description=(
        "Response cap (max_response_length): longer draws are truncated to it."))


class Generation(_Strict):
    """The rollout engines: the measured generation time of one reference batch."""

    time_s: YamlFloat = Field(..., gt=0.0, le=1e9, description=(
        "Wall time of generating one reference batch at once (long tail included) on "
        "`devices` devices, with no other phase running: seed 002's `gen` of the colocated "
        "sync row; the sync loop's trainer wait on this machine."))
    devices: YamlInt = Field(..., ge=1, le=1_000_000, description=(
        "Devices that measurement used."))
    batch_samples: YamlInt = Field(..., ge=1, le=100_000_000, description=(
        "Responses in the reference batch (prompts × n)."))
    load_knee: YamlFloat = Field(64.0, gt=0.0, le=1e6, description=(
        "Running sequences per device at which one decode iteration takes twice as long as "
        "for one sequence: iteration time = t0 · (1 + running / (devices · load_knee)). Small: "
        "throughput-bound (CPU); large: latency-bound, the long tail decides (GPU)."))
    max_running_per_device: YamlOptInt = Field(None, ge=1, le=10_000_000, description=(
        "Most sequences one device decodes at once (vLLM max_num_seqs, the embedded server's "
        "max_batch); more wait in a FIFO queue. None = unbounded."))


class Train(_Strict):
    """The trainer: measured times of one reference batch."""

    update_time_s: YamlFloat = Field(..., ge=0.0, le=1e9, description=(
        "Policy update time of one reference batch (seed 002's `update_actor`; this machine's "
        "trainer step time), on `devices` devices."))
    old_logprob_time_s: YamlFloat = Field(0.0, ge=0.0, le=1e9, description=(
        "Old-log-prob recomputation of one reference batch, spent by the colocated sync "
        "baseline only (seed 002's async rows take the rollout's log-probs: `\\`)."))
    other_time_s: YamlFloat = Field(0.0, ge=0.0, le=1e9, description=(
        "Everything else the trainer does per reference batch (reward, advantages, logging): "
        "a colocated row's step minus gen, old_log_prob and update_actor."))
    devices: YamlInt = Field(..., ge=1, le=1_000_000, description=(
        "Devices that measurement used."))
    batch_samples: YamlInt = Field(..., ge=1, le=100_000_000, description=(
        "Responses in the reference batch."))
    separate_update_time_s: YamlOptFloat = Field(None, ge=0.0, le=1e9, description=(
        "Update time of one reference batch measured with the trainer on its own "
        "`separate_devices` (seed 002's fully-async rows publish it: their own phase time). "
        "None: a separate trainer's time is update_time_s scaled by devices."))
    separate_other_time_s: YamlOptFloat = Field(None, ge=0.0, le=1e9, description=(
        "other_time_s of a separate trainer (seed 002's async rows: step − gen − update_actor). "
        "None: other_time_s."))
    separate_devices: YamlOptInt = Field(None, ge=1, le=1_000_000, description=(
        "Devices of separate_update_time_s (default: devices.train)."))
    scaling_exponent: YamlFloat = Field(1.0, ge=0.0, le=2.0, description=(
        "GPU set-ups: train time ∝ (devices_measured / devices_used) ^ exponent (1 = linear)."))


class Sync(_Strict):
    """Parameter synchronisation trainer → rollout engines."""

    time_s: YamlFloat = Field(0.0, ge=0.0, le=1e9, description=(
        "Seconds of one weight sync; trainer and engines both wait (seed 002: 0.02 s for 7B "
        "with the checkpoint engine)."))


class Knobs(_Strict):
    """The recipe's async knobs (a recipe passed to ``asyncrl simulate`` overrides them)."""

    mode: Literal["sync", "one_step", "fully_async"] = Field("fully_async", description=(
        "sync | one_step | fully_async, as the recipe's async.mode."))
    colocated: YamlBool = Field(False, description=(
        "sync only: generation and training take turns on all devices (seed 002's colocate)."))
    staleness_threshold: YamlFloat = Field(0.5, ge=0.0, le=16.0, description=(
        "fully_async: the rollouter may submit (1 + threshold) × trigger_parameter_sync_step × "
        "samples per step between two syncs (sync 0, one_step 1)."))
    trigger_parameter_sync_step: YamlInt = Field(1, ge=1, le=1024, description=(
        "Trainer steps between two weight syncs (fully_async; 1 otherwise)."))
    require_batches: YamlInt = Field(1, ge=1, le=1024, description=(
        "Mini-batches per trainer step."))
    partial_rollout: YamlBool = Field(True, description=(
        "fully_async: a sync pauses in-flight generation instead of waiting for it."))
    max_ahead_steps: YamlOptInt = Field(None, ge=0, le=1000, description=(
        "Seed 004's η: submit only while ⌊(N_r − 1)/B⌋ ≤ i + η. None = off."))
    batch_prompts: YamlInt = Field(8, ge=1, le=1_000_000, description=(
        "Prompts per mini-batch (ppo_mini_batch_size)."))
    n: YamlInt = Field(8, ge=1, le=4096, description="Responses per prompt.")
    steps: YamlInt = Field(12, ge=1, le=1_000_000, description=(
        "Trainer steps of the run (its ramp-up counts in the mean step time)."))

    @model_validator(mode="after")
    def _colocated(self) -> Knobs:
        if self.colocated and self.mode != "sync":
            raise ValueError(f"colocated applies to mode sync only, got mode {self.mode}; set "
                             "colocated: false")
        return self

    @property
    def samples_per_step(self) -> int:
        """Responses one trainer step consumes: require_batches × batch_prompts × n."""
        return self.require_batches * self.batch_prompts * self.n


class SimSettings(_Strict):
    """How finely the run is simulated (the result is deterministic given these)."""

    seed: YamlInt = Field(0, ge=0, le=2**31 - 1, description="Seed of the response lengths.")
    max_samples_per_step: YamlInt = Field(256, ge=8, le=1_000_000, description=(
        "A step larger than this is simulated at this size, devices scaled alike (each "
        "simulated response stands for several)."))
    max_steps: YamlInt = Field(48, ge=1, le=100_000, description=(
        "A run longer than this is simulated for this many steps (the mean step time of a long "
        "run is its steady state)."))


class Figure(_Strict):
    """A published or measured figure the model is checked against."""

    name: str = Field(..., min_length=1, max_length=200, description="What was measured.")
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "This row's changes to the calibration, by section (knobs, devices, generation, train, "
        "sync, lengths): its own knobs and published phase times."))
    metric: Literal["speedup", "speedup_over_sync", "step_time_s", "total_time_s"] = Field(
        ..., description="Which prediction the figure is: speed-up over colocated sync, over "
        "sync on the same split, mean step time, or the run's total time.")
    value: YamlFloat = Field(..., gt=0.0, description="The published or measured value.")
    source: str = Field("", max_length=500, description="Where the figure comes from.")
    reproduced: YamlBool = Field(True, description=(
        "False: a known miss (more than 15 % off), explained in docs/findings/simulator.md; "
        "the table still prints it."))


class Calibration(_Strict):
    """One set-up's phase times, resources and lengths; optional knobs and figures."""

    name: str = Field(..., min_length=1, max_length=200, description="Label of the set-up.")
    description: str = Field("", max_length=4000, description="Free text: where times come from.")
    devices: Devices = Field(..., description="The resource split.")
    lengths: Lengths = Field(..., description="The response-length distribution.")
    generation: Generation = Field(..., description="Generation phase time.")
    train: Train = Field(..., description="Train phase times.")
    sync: Sync = Field(default_factory=Sync, description="Weight sync time.")
    knobs: Knobs | None = Field(None, description=(
        "The async knobs this calibration describes (a recipe overrides them). None: "
        "`asyncrl simulate` needs a recipe."))
    sim: SimSettings = Field(default_factory=SimSettings, description="Simulation settings.")
    figures: list[Figure] = Field(default_factory=list, description=(
        "Published or measured figures to reproduce (`asyncrl simulate --validate`)."))


def calibration_from_dict(data: Any, source: str = "calibration") -> Calibration:
    """Validate plain data → :class:`Calibration`; errors → one-line :class:`CalibrationError`."""
    data = require_mapping(data, f"{source}: a calibration is a mapping (devices, lengths, "
                           "generation, train, ...)", CalibrationError)
    try:
        return Calibration.model_validate(dict(data))
    except ValidationError as err:
        raise CalibrationError(format_validation_error(err, source, _HINT)) from None


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration YAML file."""
    p = Path(path)
    data = read_yaml(p, "calibration", "pass the path of a calibration YAML (see "
                     "benchmarks/sim/)", CalibrationError)
    return calibration_from_dict(data, str(p))
