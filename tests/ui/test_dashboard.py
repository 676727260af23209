"""The dashboard's views on a registry and run directories written by asyncrl's own writers
(RegistryDB, JsonlSink, append_eval): numbers checked by hand, the pages through FastAPI's
client, and the live ladder in a real browser (Debian's chromium) while a campaign "runs" — a
campaign owned by this test process, whose rows the test writes as a campaign would."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ui.dashboard import data as D
from ui.dashboard.app import DashboardConfig, create_app

HASH_A, HASH_B = "a" * 64, "b" * 64


def _run_dir(root: Path, name: str, steps: int, trained_per_step: int = 16,
             rewards: tuple[float, ...] = (1.0, 0.0, 1.0, 1.0)) -> Path:
    from training.evals import EvalOutcome, append_eval
    from training.runtime.sinks import JsonlSink

    run_dir = root / name
    sink = JsonlSink(run_dir / "metrics.jsonl")
    sink.log(0, {"step/eval_only": 1, "eval/reward_mean": 0.5})
    for s in range(steps):
        sink.log(s, {"async/trained_samples": trained_per_step * (s + 1),
                     D.TRAIN_ROLLOUT: float(s + 1), D.ENGINE: 0.5, D.UPDATE: 0.1 * (s + 1),
                     D.REWARD: s / 10, "async/staleness/max": float(s % 3),
                     "async/staleness/hist/0": 10.0, "async/staleness/hist/1": 6.0,
                     "policy/entropy/mean": 2.0, "is/engine/ess": 0.9})
    sink.close()
    append_eval(run_dir / "eval.jsonl", EvalOutcome(step=steps - 1, eval_only=False,
                                                    prompts="p", rewards=rewards))
    return run_dir


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A campaign of two stages: baseline (promoted) and async (one failed, one running)."""
    from registry.db import RegistryDB

    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ASYNCRL_REGISTRY_URL", raising=False)
    db = RegistryDB()
    db.create_campaign("c-1", "demo", {"campaign": {"name": "demo", "stages": [
        {"name": "baseline", "description": "the synchronous start"},
        {"name": "async", "candidates": [{"name": "one-step", "description": "one step of lag"}]},
    ]}, "base_recipe_hash": HASH_A})
    db.put_recipe(HASH_A, "base", "name: base\nasync: {mode: sync}\noptim: {lr: 1.0e-5}\n")
    db.put_recipe(HASH_B, "one", "name: one\nasync: {mode: one_step}\noptim: {lr: 1.0e-5}\n")
    db.set_campaign_status("c-1", "running")
    db.upsert_stage("c-1", "baseline", 0, "finished")
    db.upsert_stage("c-1", "async", 1, "running")
    base = db.upsert_run("c-1", "baseline", "default", HASH_A, status="finished",
                         run_dir=str(_run_dir(tmp_path, "base", 8)))
    db.record_gate_results(base, [{"name": "staleness_within_bound", "passed": True,
                                   "value": 0.0, "threshold": 0.0, "evidence": "peaked at 0"}])
    db.promote(recipe_hash=HASH_A, candidate="default", checkpoint=str(tmp_path / "base"),
               campaign_id="c-1",
               stage="baseline", actor="auto", reason="first_passing: passed 1 gate")
    bad = db.upsert_run("c-1", "async", "one-step", HASH_B, status="rejected",
                        run_dir=str(_run_dir(tmp_path, "one", 4)))
    db.record_gate_results(bad, [{"name": "staleness_within_bound", "passed": False,
                                  "value": 1.0, "threshold": 0.0,
                                  "evidence": "async/staleness/max peaked at 1 > the bound 0",
                                  "params": {"max_staleness": 0}, "noise": 0.25}])
    db.close()
    yield tmp_path


def test_key_numbers_by_hand(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "r", 8)
    k = D.key_numbers(str(run_dir), {})
    assert k.final_reward == pytest.approx(0.7)  # the last step's reward
    # eval rewards 1, 0, 1, 1: mean 0.75, sample SD 0.5, SE 0.5 / √4 = 0.25
    assert (k.eval_mean, k.eval_n) == (0.75, 4) and k.eval_se == pytest.approx(0.25)
    assert k.train_rollout_gap == pytest.approx(7.5)  # last quarter of 1..8: (7 + 8) / 2
    assert k.update_size == pytest.approx(0.75)
    assert k.engine_gap == 0.5 and k.max_staleness == 2.0
    empty = D.key_numbers(None, {"rollout/reward_mean": 0.3, "eval/reward_mean": float("nan")})
    assert empty.final_reward == 0.3 and empty.eval_mean is None and empty.eval_se is None


def test_series_are_aligned_on_samples_trained() -> None:
    hist = [{"step": 0, "step/eval_only": 1, "eval/reward_mean": 0.2},
            {"step": 0, "x": 1.0, "async/trained_samples": 16},
            {"step": 1, "x": None, "async/trained_samples": 32},
            {"step": 1, "x": 3.0, "async/trained_samples": 32}]  # a resumed run redid step 1
    s = D.RunSeries.of(hist)
    assert s.by_key["eval/reward_mean"] == [(0.0, 0.2)]
    assert s.by_key["x"] == [(16.0, 1.0), (32.0, 3.0)]
    no_counter = D.RunSeries.of([{"step": 0, "x": 1.0}, {"step": 1, "x": float("nan")}], 24)
    assert no_counter.by_key["x"][0] == (24.0, 1.0) and math.isnan(no_counter.by_key["x"][1][1])
    assert no_counter.points("x") == [(24.0, 1.0)]


def test_recipe_diff_and_gate_margins() -> None:
    before = {"name": "a", "async": {"mode": "sync"}, "model": {"kind": "warmstart", "seed": 1}}
    after = {"name": "b", "async": {"mode": "one_step"},
             "model": {"kind": "checkpoint", "path": "/p", "origin": f"recipe:{HASH_A}"}}
    diff = D.recipe_diff(before, after, HASH_A)
    assert [(c.key, c.before, c.after) for c in diff] == [
        ("model", f"as recipe {HASH_A[:12]}", "its promoted checkpoint /p"),
        ("async.mode", "sync", "one_step")]
    assert [c.key for c in D.recipe_diff(before, after)] == [
        "async.mode", "model.kind", "model.origin", "model.path", "model.seed"]
    g = D.GateView("g", False, 1.0, 0.25, "", None, noise=0.25)
    assert g.margin == 0.75 and g.margin_se == pytest.approx(3.0)
    assert D.GateView("g", True, None, 0.25, "", None).margin is None


def test_pages(registry: Path) -> None:
    client = TestClient(create_app(DashboardConfig()))
    index = client.get("/")
    assert index.status_code == 200 and "c-1" in index.text and "baseline/default" in index.text
    page = client.get("/campaign/c-1").text
    assert "crashed" in page  # recorded running, no live owner: crashed, and not polled
    assert 'data-live="0"' in page
    assert "(+4.0 SE)" in page  # margin 1 − 0 over the recorded noise 0.25
    assert "one step of lag" in page and "the synchronous start" in page
    run = client.get("/campaign/c-1/run/2").text
    assert 'id="chart-logprob"' in run and "<code>async.mode</code>" in run
    assert "reference (baseline/default)" in run  # the previous stage's promotion
    registry_page = client.get("/registry").text
    assert "first_passing: passed 1 gate" in registry_page
    missing = client.get("/campaign/nope")
    assert missing.status_code == 404 and "no campaign &#39;nope&#39;" in missing.text
    assert "Traceback" not in missing.text
    assert client.get("/run/c-1/2/files/metrics.jsonl").status_code == 200
    out = client.get("/run/c-1/2/files/%2e%2e/base/metrics.jsonl")
    assert out.status_code == 404 and "outside the run directory" in out.text
    assert client.get("/static/plotly.min.js").headers["content-type"].startswith(
        "application/javascript")


def test_empty_registry_is_not_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "fresh"))
    monkeypatch.delenv("ASYNCRL_REGISTRY_URL", raising=False)
    client = TestClient(create_app())
    assert "No campaigns in the registry" in client.get("/").text
    assert client.get("/campaign/x").status_code == 404
    assert not (tmp_path / "fresh" / "registry.db").exists()


def test_the_ladder_updates_live_in_a_browser(registry: Path, browser, dashboard_server) -> None:
    """While the campaign's owner is alive the ladder polls: a run the campaign records after
    the page opened appears without a reload; once the campaign ends the page says so and
    stops polling."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from registry.db import RegistryDB
    from registry.ownership import HEARTBEAT_TTL_S
    from training.ownership import ProcessIdentity

    db = RegistryDB()
    me = ProcessIdentity.current()
    with dashboard_server(registry / "home") as url:
        db.acquire_campaign("c-1", me, HEARTBEAT_TTL_S)  # a fresh heartbeat: the owner is alive
        d = browser.open(f"{url}/campaign/c-1", wait_for=".cell")
        assert d.find_element(By.CSS_SELECTOR, ".ladder").get_attribute("data-live") == "1"
        assert not d.find_elements(By.CSS_SELECTOR, ".cell[data-candidate='two-step']")
        t0 = time.monotonic()
        db.upsert_run("c-1", "async", "two-step", HASH_B, status="running")
        WebDriverWait(d, 20).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".cell[data-candidate='two-step']"))
        assert time.monotonic() - t0 < 15
        db.set_campaign_status("c-1", "finished", verdict="all 2 stages promoted")
        db.release_campaign("c-1", me.token)
        WebDriverWait(d, 20).until(lambda d: d.find_element(
            By.CSS_SELECTOR, ".ladder").get_attribute("data-live") == "0")
        assert "all 2 stages promoted" in d.find_element(By.CSS_SELECTOR, ".summary").text
        assert not browser.errors()
    db.close()
