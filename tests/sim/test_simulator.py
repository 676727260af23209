"""The async-pipeline simulator (training/sim, `asyncrl simulate`): hand-computed event loops,
invariants, the validation tables of benchmarks/sim/ within 15 %, the CLI, and a calibration
written from a real tiny run directory."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from training.sim.calibration import (
    Calibration,
    CalibrationError,
    calibration_from_dict,
    load_calibration,
)
from training.sim.model import Pipeline, simulate
from training.sim.predict import predict, predict_knobs
from training.sim.validate import validation_table
from ui.cli import app

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "benchmarks" / "sim"
runner = CliRunner()


def pipe(**kw) -> Pipeline:
    """Fixed lengths (σ = 0) of 10 tokens, 4 responses per step, latency-bound engines."""
    base = dict(steps=3, samples_per_step=4, sync_interval=1, quota_threshold=0.0,
                partial_rollout=False, lockstep=True, max_ahead_steps=None, t0=0.1, knee=1e12,
                max_running=None, train_cost_per_sample=0.5, sync_s=0.25, mean_tokens=10.0,
                sigma=0.0, max_tokens=100.0)
    return Pipeline(**{**base, **kw})


def cal_dict(**sections) -> dict:
    data = {
        "name": "hand", "devices": {"kind": "gpu", "total": 8, "rollout": 4, "train": 4},
        "lengths": {"mean_tokens": 100, "sigma": 0.0, "max_tokens": 100},
        "generation": {"time_s": 10.0, "devices": 8, "batch_samples": 64, "load_knee": 1e6},
        "train": {"update_time_s": 6.0, "old_logprob_time_s": 2.0, "other_time_s": 1.0,
                  "devices": 8, "batch_samples": 64},
        "sync": {"time_s": 0.5},
        "knobs": {"mode": "one_step", "batch_prompts": 8, "n": 8, "steps": 8},
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value}
    return data


# --- the event loop, by hand --------------------------------------------------------------------


def test_sync_step_is_gen_plus_train_plus_sync():
    # gen: 10 tokens × 0.1 s = 1.0 s; train: 4 × 0.5 = 2.0 s; sync 0.25 s
    r = simulate(pipe())
    assert r.wall_s == pytest.approx(3 * 3.25)
    assert r.gen_wait_s == pytest.approx(3 * 1.0)
    assert r.train_s == pytest.approx(3 * 2.0)
    assert r.mean_staleness == 0


def test_generation_closed_form_with_a_load_knee():
    # T = t0 · (L_max + ΣL / knee) = 0.1 · (10 + 40 / 2) = 3.0 s
    r = simulate(pipe(steps=1, knee=2.0, train_cost_per_sample=0.0, sync_s=0.0))
    assert r.wall_s == pytest.approx(3.0)


def test_one_step_steady_state_is_max_of_gen_and_train_plus_sync():
    # batches 0 and 1 generate together (1.0 s); then every step is max(1.0, 2.0) + 0.25
    r = simulate(pipe(steps=5, quota_threshold=1.0))
    assert r.wall_s == pytest.approx(1.0 + 5 * 2.25)
    assert r.mean_staleness == pytest.approx(4 / 5)  # batches 1..4 were one sync behind


def test_contention_slows_both_phases():
    # one_step with gen 2.0 and train 2.0 per step: 2.4 cores demanded on 2 → both at 2/2.4
    base = dict(steps=6, quota_threshold=1.0, t0=0.2, sync_s=0.0)
    free = simulate(pipe(**base))
    busy = simulate(pipe(**base, cores=2.0, engine_cores=1.0, train_cores=1.0,
                         overhead_cores=0.4))
    assert busy.contention_factor == pytest.approx(2 / 2.4)
    assert busy.wall_s > free.wall_s * 1.1


def test_predict_colocated_sync_reproduces_its_own_phase_times():
    cal = calibration_from_dict(cal_dict())
    p = predict_knobs(cal.knobs.model_copy(update={"mode": "sync", "colocated": True}), cal)
    # gen 10 + old_logprob 2 + update 6 + other 1 + sync 0.5 on all 8 devices
    assert p.colocated_step_time_s == pytest.approx(19.5)
    assert p.step_time_s == pytest.approx(19.5)
    assert p.speedup == pytest.approx(1.0)


def test_predict_one_step_on_the_split():
    # separate: gen on 4 devices, latency-bound: still 10 s; train (6 + 1) × 8/4 = 14 s
    cal = calibration_from_dict(cal_dict())
    p = predict(None, cal)
    assert p.sync_step_time_s == pytest.approx(10 + 14 + 0.5, rel=1e-4)
    # 8 steps: 10 s first batch, then max(10, 14) + 0.5 per step
    assert p.step_time_s == pytest.approx((10 + 8 * 14.5) / 8, rel=1e-4)
    assert p.overlap_limit == pytest.approx(24.5 / 14.5, rel=1e-4)
    assert "one_step" in p.explanation


# --- invariants ---------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(gen=st.floats(0.5, 20), train=st.floats(0.5, 20), sigma=st.floats(0, 1.5),
       mode=st.just("one_step"), theta=st.floats(0, 1))
def test_one_step_never_beats_the_overlap_limit(gen, train, sigma, mode, theta):
    """One-step only overlaps one batch's generation with the last one's training, so it can
    never beat (T_gen + T_train) / max(T_gen, T_train). Fully async can: streaming and partial
    rollout also cut each batch's wait for its longest responses (seed 002's calibration:
    1.56 of the limit), so it is not held to it."""
    cal = calibration_from_dict(cal_dict(
        lengths={"sigma": sigma, "mean_tokens": 50, "max_tokens": 400},
        generation={"time_s": gen, "devices": 4, "load_knee": 8},
        train={"update_time_s": train, "old_logprob_time_s": 0.0, "other_time_s": 0.0,
               "devices": 4},
        knobs={"mode": mode, "staleness_threshold": theta, "steps": 12}))
    p = predict(None, cal)
    assert p.speedup_over_sync <= p.overlap_limit * 1.02


def test_more_staleness_is_never_slower():
    cal = load_calibration(SIM / "seed-002.yaml")
    times = [predict_knobs(cal.knobs.model_copy(update={"staleness_threshold": th}),
                           cal).step_time_s for th in (0.0, 0.1, 0.3, 0.5, 1.0)]
    for slower, faster in itertools.pairwise(times):
        assert faster <= slower * 1.03, times


def test_deterministic_given_the_seed():
    cal = load_calibration(SIM / "this-machine.yaml")
    assert predict(None, cal) == predict(None, cal)
    other = cal.model_copy(update={"sim": cal.sim.model_copy(update={"seed": 7})})
    assert predict(None, other).step_time_s != predict(None, cal).step_time_s


# --- the shipped calibrations reproduce their figures -------------------------------------------


@pytest.mark.parametrize("name", ["seed-002.yaml", "this-machine.yaml"])
def test_validation_table_within_15_percent(name):
    rows = validation_table(load_calibration(SIM / name))
    assert rows
    misses = [(r.figure.name, f"{r.error:+.1%}") for r in rows
              if r.figure.reproduced and abs(r.error) > 0.15]
    assert not misses, misses


def test_seed_002_figures_are_all_there():
    rows = validation_table(load_calibration(SIM / "seed-002.yaml"))
    assert rows[0].figure.name.startswith("128 GPUs, fully async")
    names = " ".join(r.figure.name for r in rows)
    for needle in ("128 GPUs", "streaming alone", "staleness 0,", "staleness 0.1",
                   "staleness 0.3", "staleness 0.5", "require_batches 1", "require_batches 2",
                   "require_batches 4", "64 GPUs", "32 GPUs"):
        assert needle in names
    assert 2.0 <= rows[0].predicted <= 2.7  # 128 GPUs: seed 002's 2.35x-2.67x


def test_this_machine_explains_the_efficiency():
    p = predict(None, load_calibration(SIM / "this-machine.yaml"))
    assert p.cores_demanded == pytest.approx(2.4)
    assert "2.4 cores demanded on 2" in p.explanation
    assert 0.45 <= p.efficiency <= 0.7  # measured 0.58


# --- the CLI -------------------------------------------------------------------------------------


def _one_line_error(res, *needles: str) -> str:
    assert res.exit_code == 1, res.output
    err = res.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in err, err
    return err


def test_cli_json_has_speedup():
    res = runner.invoke(app, ["simulate", "--calibration", str(SIM / "seed-002.yaml"),
                              "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert 2.0 < out["speedup"] < 2.7
    assert out["mode"] == "fully_async" and out["explanation"]


def test_cli_recipe_overrides_the_knobs():
    res = runner.invoke(app, ["simulate", "-c", str(SIM / "this-machine.yaml"),
                              str(ROOT / "tests" / "tiny-recipe.yaml"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["mode"] == "sync" and out["knobs"]["steps"] == 2


def test_cli_prints_the_table():
    res = runner.invoke(app, ["simulate", "-c", str(SIM / "this-machine.yaml"), "--validate"])
    assert res.exit_code == 0, res.output
    assert "| fully_async over sync" in res.stdout


def test_cli_bad_input_is_one_line(tmp_path):
    _one_line_error(runner.invoke(app, ["simulate", "-c", str(tmp_path / "nope.yaml")]),
                    "does not exist")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndevices: [1, 2\n")
    _one_line_error(runner.invoke(app, ["simulate", "-c", str(bad)]), "not valid YAML")
    data = cal_dict()
    data["train"]["speed"] = 3
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(yaml.safe_dump(data))
    _one_line_error(runner.invoke(app, ["simulate", "-c", str(unknown)]),
                    "train.speed", "unknown field")
    _one_line_error(runner.invoke(app, ["simulate"]), "--calibration")
    data = cal_dict()
    data.pop("knobs")
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump(data))
    _one_line_error(runner.invoke(app, ["simulate", "-c", str(bare)]), "pass a RECIPE")
    _one_line_error(runner.invoke(app, ["simulate", "--from-run", str(tmp_path), "-o",
                                        str(tmp_path / "c.yaml")]), "recipe.yaml")


def test_calibration_rules():
    with pytest.raises(CalibrationError, match="exceed total"):
        calibration_from_dict(cal_dict(devices={"rollout": 8}))
    with pytest.raises(CalibrationError, match="colocated"):
        calibration_from_dict(cal_dict(knobs={"mode": "fully_async", "colocated": True}))
    assert isinstance(calibration_from_dict(cal_dict()), Calibration)


# --- a calibration from a real run directory ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """tests/tiny-recipe.yaml run for real (2 sync steps of 16 responses; ~2 s warm start)."""
    from training.recipe import load_recipe
    from training.runtime.run import run_recipe

    home = tmp_path_factory.mktemp("home")
    old = os.environ.get("ASYNCRL_HOME")
    os.environ["ASYNCRL_HOME"] = str(home)
    try:
        res = run_recipe(load_recipe(ROOT / "tests" / "tiny-recipe.yaml"),
                         out=tmp_path_factory.mktemp("run") / "run", checkpoint_every=0)
        yield res.run_dir
    finally:
        if old is None:
            os.environ.pop("ASYNCRL_HOME", None)
        else:
            os.environ["ASYNCRL_HOME"] = old


@pytest.mark.slow
def test_calibrate_from_a_real_run(tiny_run, tmp_path):
    out = tmp_path / "cal.yaml"
    res = runner.invoke(app, ["simulate", "--from-run", str(tiny_run), "-o", str(out)])
    assert res.exit_code == 0, res.output
    cal = load_calibration(out)
    assert cal.knobs is not None and cal.knobs.mode == "sync" and cal.knobs.steps == 2
    assert cal.devices.kind == "cpu" and cal.generation.batch_samples == 16
    assert cal.generation.time_s > 0 and cal.train.update_time_s > 0
    assert cal.lengths.max_tokens == 16
    res = runner.invoke(app, ["simulate", "-c", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["speedup"] > 0
