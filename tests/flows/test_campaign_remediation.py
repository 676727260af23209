"""Stages that repair themselves, end to end (issue 28): Prefect, Ray, the embedded engines,
MLflow and the registry.

**Repaired**, on the stress testbed's recipe (shrunk as in test_stress_gates.py).

Stage ``precision`` tries one candidate, ``fp8``: rollouts in fp8 while the trainer is fp32, so
the engine gap (same weights) rises above the re-run baseline's beyond its noise and
``engine_mismatch_flat`` (max_ratio 1.1) rejects it. The stage has ``remediate:``; the failed
gate is a symptom of seed 001's cause A (precision / kernel / engine mismatch), whose fix —
"align rollout and train precision", for a dense model on the embedded rollout
``engines.rollout_dtype: fp32`` — runs as ``remedy-1``, passes the same gates and is promoted.

**Not repairable**, on the tiny recipe: one-step training against a staleness bound of 0 — no
fix the seeds prescribe changes the async mode, so both attempts fail and the campaign stops
listing them. Its dashboard page is checked in a real browser (the docs' third screenshot).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # 4 small stress runs and 3 tiny ones (≈2.5 min)

REPO = Path(__file__).resolve().parents[2]
SMALL = {
    "steps": 8,
    "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32, "num_layers": 2,
              "moe_experts": 0},
    "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 16},
    "engines": {"num_rollout_engines": 1},
    "eval": {"every": 0, "n": 4},
}
CAMPAIGN = {
    "name": "repair-e2e",
    "base": str(REPO / "recipes" / "stress-sync.yaml"),
    "stages": [
        {"name": "baseline", "overrides": SMALL, "gates": [{"name": "reward_not_collapsed"}]},
        {"name": "precision", "steps": 8, "rerun_reference": True,
         "description": "fp8 rollouts for throughput, if the engine gap allows it",
         "candidates": [{"name": "fp8", "overrides": {"engines": {"rollout_dtype": "fp8"}}}],
         "gates": [{"name": "engine_mismatch_flat", "relative_to": "baseline",
                    "params": {"max_ratio": 1.1}},
                   {"name": "logprob_diff_flat", "relative_to": "baseline"}],
         "remediate": {"max_attempts": 2}},
    ],
}


TINY = yaml.safe_load((Path(__file__).parents[1] / "tiny-recipe.yaml").read_text())
# no candidate can pass: one-step training is one step stale and the gate allows none; no remedy
# the seeds prescribe changes the async mode, so every attempt fails the same gate
UNREPAIRABLE = {
    "name": "e2eremedy",
    "base": TINY,
    "stages": [{"name": "only",
                "candidates": [{"name": "one-step", "overrides": {
                    "async": {"mode": "one_step"}, "algorithm": {"old_logprob": "snapshot"}}}],
                "gates": [{"name": "staleness_within_bound", "params": {"max_staleness": 0}}],
                "remediate": {"max_attempts": 2}}],
}
EVENTS: list = []  # the progress events of the unrepairable campaign


@pytest.fixture(scope="module")
def campaign_run(tmp_path_factory, run_campaign):
    from flows.campaign import EVENT_LISTENERS, campaign_flow

    with run_campaign(tmp_path_factory, "repair-e2e", copy.deepcopy(CAMPAIGN)) as (home, path):
        repaired = campaign_flow(str(path), "repair-1", return_state=True)
        other = home / "e2eremedy.yaml"
        other.write_text(yaml.safe_dump(UNREPAIRABLE))
        EVENT_LISTENERS.append(EVENTS.append)
        try:
            campaign_flow(str(other), "e2e-remedy", return_state=True)
        finally:
            EVENT_LISTENERS.pop()
        yield home, repaired


def test_the_unstable_candidate_is_repaired_by_its_remedy(campaign_run):
    from registry.db import RegistryDB

    _, state = campaign_run
    assert state.type.value == "COMPLETED"  # Prefect: the flow run ended well
    out = state.result()
    assert out.status == "finished", out.verdict
    assert out.promoted["precision"].candidate == "remedy-1"
    db = RegistryDB()
    try:
        runs = {r.candidate: r for r in db.runs("repair-1", "precision")}
        (attempt,) = db.remediations("repair-1", "precision")
        gates = {c: {g.name: g for g in db.gate_results(runs[c].id)}
                 for c in ("fp8", "remedy-1")}
        remedy_recipe = yaml.safe_load(db.get_recipe(runs["remedy-1"].recipe_hash).yaml)
        promo = db.promoted("repair-1", "precision")
    finally:
        db.close()
    assert set(runs) == {"reference-baseline", "fp8", "remedy-1"}
    assert runs["fp8"].status == "rejected" and runs["remedy-1"].status == "finished"
    # the candidate: its engine gap above the re-run baseline's, beyond the limit
    bad = gates["fp8"]["engine_mismatch_flat"]
    assert not bad.passed and bad.value > bad.threshold and bad.noise > 0
    assert "vs the reference's" in bad.evidence
    # the remediation: seed 001's A for the failed gate, recorded with its evidence and override
    assert (attempt.attempt, attempt.from_candidate, attempt.candidate, attempt.status) == (
        1, "fp8", "remedy-1", "passed")
    assert attempt.cause == "A" and attempt.title == "precision / kernel / engine mismatch"
    assert attempt.source == "seed 001 for the failed gate engine_mismatch_flat (cause A)"
    assert attempt.override == {"algorithm.old_logprob": "snapshot",
                                "engines.rollout_dtype": "fp32"}
    assert attempt.evidence == [bad.evidence] and attempt.diagnosis["summary"]
    assert remedy_recipe["engines"]["rollout_dtype"] == "fp32"
    # the remedy passes the same gates: its engine gap is the trainer's own precision's
    good = gates["remedy-1"]["engine_mismatch_flat"]
    assert good.passed and good.value <= good.threshold
    assert all(g.passed for g in gates["remedy-1"].values())
    assert promo.candidate == "remedy-1" and "first_passing" in promo.reason


def test_mlflow_and_prefect_show_the_remediation(campaign_run):
    from mlflow import MlflowClient
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.campaign import model_name
    from flows.tracking import default_tracking_uri
    from registry.db import RegistryDB

    db = RegistryDB()
    try:
        remedy = db.get_run(campaign_id="repair-1", stage="precision", candidate="remedy-1")
    finally:
        db.close()
    client = MlflowClient(tracking_uri=default_tracking_uri())
    run = client.get_run(remedy.mlflow_run_id)
    tags = run.data.tags
    assert tags["asyncrl.remediation.cause"] == "A"
    assert tags["asyncrl.remediation.from"] == "fp8"
    assert json.loads(tags["asyncrl.remediation.override"])["engines.rollout_dtype"] == "fp32"
    assert tags["asyncrl.promoted"] == "true"
    assert "remediation 1 of fp8: cause A" in tags["mlflow.note.content"]
    version = client.get_model_version_by_alias(model_name("repair-e2e"), "champion")
    assert version.tags["asyncrl.candidate"] == "remedy-1"

    import asyncio

    async def artifact() -> str:
        async with get_client() as c:
            arts = await c.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["repair-1-precision"])))
            return arts[0].data

    text = asyncio.run(artifact())
    assert "remedy-1" in text and "**Promoted:** `remedy-1`" in text


def test_a_stage_that_cannot_be_repaired_stops_after_max_attempts(campaign_run):
    """remediate: {max_attempts: 2} on a stage whose gate no remedy can meet (one step of lag
    against a staleness bound of 0): two remedies run, each on top of the last and each from the
    diagnosis of the run before it; both fail; the campaign stops listing the attempts and the
    diagnoses. Each attempt is recorded (registry, MLflow, events) and replays by hand: the
    recorded override on the recorded starting recipe is the remedy's recipe."""
    import yaml as _yaml
    from mlflow import MlflowClient

    from flows.events import RemediationEvent
    from flows.tracking import default_tracking_uri
    from registry.db import RegistryDB
    from training.recipe import recipe_from_dict

    db = RegistryDB()
    c = db.get_campaign("e2e-remedy")
    assert c.status == "stopped"
    attempts = db.remediations("e2e-remedy")
    runs = {r.candidate: r for r in db.runs("e2e-remedy")}
    assert [(a.attempt, a.from_candidate, a.candidate, a.status) for a in attempts] == [
        (1, "one-step", "remedy-1", "failed"), (2, "remedy-1", "remedy-2", "failed")]
    assert set(runs) == {"one-step", "remedy-1", "remedy-2"}
    assert all(runs[n].status == "rejected" for n in runs)
    for a in attempts:
        assert a.cause and a.title and a.source and a.override and a.evidence
        assert a.diagnosis and "summary" in a.diagnosis
        # replay by hand: the override on the recipe it started from
        start = recipe_from_dict(_yaml.safe_load(db.get_recipe(
            runs[a.from_candidate].recipe_hash).yaml))
        from registry.remediation import apply_remedy

        assert apply_remedy(start, a.override, "replay").hash() == runs[a.candidate].recipe_hash
        gates = {g.name: g for g in db.gate_results(runs[a.candidate].id)}
        assert not gates["staleness_within_bound"].passed
    assert attempts[0].override != attempts[1].override  # the second is a new remedy
    assert "remediation: attempt 1 (remedy-1 from one-step, cause" in c.verdict
    assert "attempt 2 (remedy-2 from remedy-1, cause" in c.verdict and "diagnosis:" in c.verdict
    # MLflow: the remedy's run says what it is and carries the remediation
    client = MlflowClient(tracking_uri=default_tracking_uri())
    child = client.get_run(runs["remedy-1"].mlflow_run_id)
    assert child.data.tags["asyncrl.remediation.from"] == "one-step"
    assert child.data.tags["asyncrl.remediation.cause"] == attempts[0].cause
    assert "remediation 1 of one-step" in child.data.tags["mlflow.note.content"]
    assert "remediation.json" in {f.path for f in client.list_artifacts(child.info.run_id)}
    events = [e for e in EVENTS if isinstance(e, RemediationEvent)]
    assert [(e.attempt, e.candidate) for e in events] == [(1, "remedy-1"), (2, "remedy-2")]
    db.close()


def test_the_dashboard_shows_the_attempts(campaign_run, browser, dashboard_server):
    """The unrepairable campaign in the dashboard (Debian's chromium): its attempts under the
    stage with cause and verdict, each remedy's cell saying what it repairs; the repaired
    campaign's remedy marked promoted."""
    from selenium.webdriver.common.by import By

    home, _ = campaign_run
    with dashboard_server(home) as url:
        # the campaign that tried to repair itself: its attempts under the stage, each remedy's
        # cell saying what it fixes and from which run
        d = browser.open(f"{url}/campaign/e2e-remedy", wait_for=".remediations")
        items = d.find_elements(By.CSS_SELECTOR, ".remediations li.remediation")
        assert [i.get_attribute("data-attempt") for i in items] == ["1", "2"]
        assert "remedy-1 from one-step: cause" in items[0].text and "failed" in items[0].text
        cell = d.find_element(By.CSS_SELECTOR, ".cell[data-candidate='remedy-2']")
        assert "remediation 2 of remedy-1" in cell.find_element(By.CSS_SELECTOR, ".remedy").text
        browser.shot("dashboard-remediation.png")
        d = browser.open(f"{url}/campaign/repair-1", wait_for=".cell")
        cell = d.find_element(By.CSS_SELECTOR, ".cell[data-candidate='remedy-1']")
        assert "promoted" in cell.get_attribute("class").split()
        assert "remediation 1 of fp8: cause A" in cell.text
        assert not browser.errors()
