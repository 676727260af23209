"""A gate proven by what it catches, on real runs (issue 14): one campaign through Prefect, Ray,
the embedded engines, MLflow and the registry, built on the stress recipes.

Stage ``baseline`` trains ``recipes/stress-sync.yaml``; stage ``one-step`` switches to one-step
off-policy generation (``recipes/stress-one_step.yaml``'s only change) and tries two candidates:

* ``unstable``: a learning rate so large that the first update moves the policy by several nats
  per token (``policy/update/*``) and its entropy blows up to more than twice the sync
  baseline's — seed 000's signature of a run about to collapse;
* ``stable``: a learning rate so small that one step of lag changes almost nothing.

``entropy_no_blowup`` relative to the baseline must fail the first and pass the second; the stage
runs both (``best_eval``) and promotes ``stable``. ``logprob_diff_flat`` judges both on growth
only (issue 26: in a lagged mode the level of the train–rollout gap is lag × the size of one
update, which the evidence shows beside the engine gap, and is not by itself instability).
The model is shrunk (2 layers of width 32, short warm start) so the campaign takes about 1-3
minutes on 2 cores; the recipes' own settings (MoE, 4 PPO epochs, clip-higher, one-step) are
kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # a stress campaign of 3 runs (≈1.5 min)

REPO = Path(__file__).resolve().parents[2]
SMALL = {
    "steps": 4,
    "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32, "num_layers": 2,
              "moe_experts": 4, "moe_top_k": 2},
    "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 16},
    "engines": {"num_rollout_engines": 1},
    "eval": {"every": 0, "n": 4},
}


def _campaign() -> dict:
    stress = yaml.safe_load((REPO / "recipes" / "stress-one_step.yaml").read_text())
    return {
        "name": "stress-e2e",
        "base": str(REPO / "recipes" / "stress-sync.yaml"),
        "stages": [
            {"name": "baseline", "overrides": SMALL,
             "gates": [{"name": "reward_not_collapsed"}]},
            {"name": "one-step", "overrides": {"async": stress["async"]},
             "promotion": "best_eval",
             "candidates": [
                 # the entropy bonus keeps a gradient even where every group's rewards tie
                 {"name": "unstable", "overrides": {
                     "optim": {"lr": 3e-3}, "algorithm": {"loss": {"entropy_coeff": 0.05}}}},
                 {"name": "stable", "overrides": {"optim": {"lr": 1e-7, "epochs": 1}}},
             ],
             "gates": [{"name": "entropy_no_blowup", "relative_to": "baseline",
                        "params": {"window": 2}},  # 4 steps: a 2-point median
                       {"name": "logprob_diff_flat", "relative_to": "baseline"}]},
        ],
    }


@pytest.fixture(scope="module")
def campaign_run(tmp_path_factory, run_campaign):
    from flows.campaign import campaign_flow

    with run_campaign(tmp_path_factory, "stress-e2e", _campaign()) as (_, path):
        yield campaign_flow(str(path), "stress-e2e-1")


def _reports() -> dict[str, dict]:
    from registry.db import RegistryDB

    db = RegistryDB()
    try:
        rows = {r.candidate: r for r in db.runs("stress-e2e-1") if r.stage == "one-step"}
    finally:
        db.close()
    return {c: json.loads((Path(r.run_dir) / "gate_report.json").read_text())
            for c, r in rows.items()}


def test_the_unstable_candidate_fails_the_entropy_gate_and_the_stable_one_passes(campaign_run):
    out = campaign_run
    assert out.status == "finished", out.verdict
    reports = _reports()
    assert set(reports) == {"unstable", "stable"}

    def gate(candidate: str, name: str) -> dict:
        return next(g for g in reports[candidate]["gates"] if g["name"] == name)

    bad, good = gate("unstable", "entropy_no_blowup"), gate("stable", "entropy_no_blowup")
    assert not bad["passed"] and good["passed"], (bad["evidence"], good["evidence"])
    assert not reports["unstable"]["passed"] and reports["stable"]["passed"]
    # judged against the baseline's own entropy level: the unstable run ends above 1.5× it
    ref = reports["unstable"]["judged_with"]["references"]["baseline"]
    assert bad["value"] > 1.5 and "reference level" in bad["evidence"]
    assert ref["policy/entropy/mean"] > 0
    # the headline gap is judged on growth, with the level explained, not on a multiple of sync
    for candidate in ("unstable", "stable"):
        lp = gate(candidate, "logprob_diff_flat")
        assert "1 lag-0 step(s) left out" in lp["evidence"], lp["evidence"]
        assert "level not judged in a lagged mode (engine gap" in lp["evidence"]
    assert out.promoted["one-step"].candidate == "stable"


def test_the_registry_and_mlflow_record_both_verdicts(campaign_run):
    from mlflow import MlflowClient

    from flows.tracking import default_tracking_uri
    from registry.db import RegistryDB

    db = RegistryDB()
    try:
        promoted = [p.candidate for p in db.promotions(campaign_id="stress-e2e-1")]
    finally:
        db.close()
    assert promoted == ["default", "stable"]
    client = MlflowClient(tracking_uri=default_tracking_uri())
    exp = client.get_experiment_by_name("asyncrl/stress-e2e")
    children = {r.data.tags.get("asyncrl.candidate"): r
                for r in client.search_runs([exp.experiment_id])
                if r.data.tags.get("mlflow.parentRunId")}
    assert {"unstable", "stable"} <= set(children)
    for name in ("unstable", "stable"):
        metrics = children[name].data.metrics
        assert "mismatch/train_rollout/logprob_abs_diff/mean" in metrics
        assert "mismatch/engine/logprob_abs_diff/mean" in metrics
    assert (children["unstable"].data.metrics["mismatch/train_rollout/logprob_abs_diff/mean"]
            > children["stable"].data.metrics["mismatch/train_rollout/logprob_abs_diff/mean"])
