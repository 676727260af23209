"""A campaign's ``simulate: CALIBRATION``: before each stage, each candidate's predicted speed-up
of its async settings (training.sim.predict), as an event and a launch line; information only.
And a ``simulate`` that names no calibration is one line at load time."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml

from flows.campaign import _Flow
from flows.events import PredictionEvent
from registry.campaign import CampaignError, load_campaign, simulation_calibration
from training.sim import predict
from ui.campaign_cli import _EventLines

ROOT = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((ROOT / "tests" / "tiny-recipe.yaml").read_text())


def _campaign(tmp_path: Path, simulate: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "name": "pred", "base": TINY, "simulate": simulate, "stages": [{
            "name": "async", "candidates": [
                {"name": "sync"},
                {"name": "fully", "overrides": {"async": {
                    "mode": "fully_async", "staleness_threshold": 0.5,
                    "trigger_parameter_sync_step": 1, "partial_rollout": True}}}]}]}))
    return path


def test_each_candidate_gets_its_prediction_before_the_stage(tmp_path):
    # the shipped seed-002 calibration, named relative to the campaign file
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "seed.yaml").write_text(
        (ROOT / "benchmarks" / "sim" / "seed-002.yaml").read_text())
    path = _campaign(tmp_path, "sim/seed.yaml")
    campaign, base = load_campaign(path)
    calibration = simulation_calibration(campaign, path.parent)
    assert calibration is not None
    events: list = []
    flow = _Flow(campaign=campaign, campaign_id="c", db=None, parent=None, plots=None,
                 registry_url=None, tracking_uri=None, events=events.append,
                 calibration=calibration)
    from registry.campaign import stage_recipes

    built = stage_recipes(campaign, campaign.stages[0], base, {}, start=None)
    flow.predict(campaign.stages[0], built.candidates)
    assert [e.candidate for e in events] == ["sync", "fully"]
    assert all(isinstance(e, PredictionEvent) for e in events)
    # the same numbers as asyncrl simulate's for each recipe
    for e, (_, recipe) in zip(events, built.candidates, strict=True):
        p = predict(recipe, calibration)
        assert (e.mode, e.speedup, e.step_time_s) == (p.mode, p.speedup, p.step_time_s)
    assert events[0].mode == "sync" and events[1].mode == "fully_async"
    assert events[1].speedup > events[0].speedup  # overlap and streaming pay at 128 GPUs
    out = io.StringIO()
    _EventLines(out)(events[1])
    line = out.getvalue().split(" ", 1)[1].strip()
    assert line == (f"async/fully: predicted {events[1].speedup:.2f}x over colocated sync "
                    f"(fully_async, {events[1].step_time_s:.4g} s per step; asyncrl simulate, "
                    "information only)")


def test_no_calibration_no_prediction():
    flow = _Flow(campaign=None, campaign_id="c", db=None, parent=None, plots=None,
                 registry_url=None, tracking_uri=None, events=lambda e: pytest.fail(str(e)))
    flow.predict(None, [(None, None)])  # no calibration: nothing said, nothing raised


def test_a_missing_calibration_is_one_line(tmp_path):
    path = _campaign(tmp_path, "nowhere.yaml")
    with pytest.raises(CampaignError) as err:
        load_campaign(path)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1
    assert msg.startswith(f"{path}: simulate: ") and "nowhere.yaml" in msg
