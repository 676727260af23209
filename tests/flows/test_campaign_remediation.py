"""A stage that repairs itself, end to end (issue 28): Prefect, Ray, the embedded engines,
MLflow and the registry, on the stress testbed's recipe (shrunk as in test_stress_gates.py).

Stage ``precision`` tries one candidate, ``fp8``: rollouts in fp8 while the trainer is fp32, so
the engine gap (same weights) rises above the re-run baseline's beyond its noise and
``engine_mismatch_flat`` (max_ratio 1.1) rejects it. The stage has ``remediate:``; the failed
gate is a symptom of seed 001's cause A (precision / kernel / engine mismatch), whose fix —
"align rollout and train precision", for a dense model on the embedded rollout
``engines.rollout_dtype: fp32`` — runs as ``remedy-1``, passes the same gates and is promoted.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # a campaign of 4 small stress runs (≈2 min)

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


@pytest.fixture(scope="module")
def campaign_run(tmp_path_factory, run_campaign):
    from flows.campaign import campaign_flow

    with run_campaign(tmp_path_factory, "repair-e2e", copy.deepcopy(CAMPAIGN)) as (home, path):
        yield home, campaign_flow(str(path), "repair-1", return_state=True)


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
