"""Like with like through the real stack (Prefect, Ray, embedded engines, MLflow and the registry
on SQLite): stage `next` re-runs the baseline's promoted recipe from its own starting checkpoint
(``rerun_reference``) and gives its two candidates the same data (``samples: 48``: 3 steps of 16
samples, 6 steps of 8); its relative gate reads the re-run's summary, not the original's.
The smallest model and warm start that still trains (about 2-4 minutes on 2 busy cores, most
of it Prefect's and the engines' start).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # a campaign with a re-run reference (≈1.5 min)

TINY = {
    "name": "tiny", "steps": 2,
    "model": {"kind": "warmstart", "warmstart_steps": 20, "hidden_size": 32, "num_layers": 2},
    "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 16},
    "engines": {"num_rollout_engines": 1},
    "async": {"mode": "sync"},
    "eval": {"every": 0, "n": 4},
}

CAMPAIGN = {
    "name": "refrun",
    "base": TINY,
    "stages": [
        {"name": "baseline", "gates": [{"name": "reward_not_collapsed"}]},
        {"name": "next", "rerun_reference": True, "samples": 48, "promotion": "best_eval",
         "overrides": {"optim": {"lr": 2e-6}},
         "candidates": [{"name": "full"},
                        {"name": "half", "overrides": {"rollout": {"batch_prompts": 2}}}],
         "gates": [{"name": "reward_not_collapsed"},
                   {"name": "logprob_diff_flat", "relative_to": "baseline",
                    "params": {"max_ratio": 1000.0}}]},
    ],
}


@pytest.fixture(scope="module")
def campaign_run(tmp_path_factory, run_campaign):
    from flows.campaign import campaign_flow

    with run_campaign(tmp_path_factory, "refrun", CAMPAIGN) as (_, path):
        yield campaign_flow(str(path), "refrun-1")


def test_the_reference_is_rerun_from_the_stages_start_and_the_gate_reads_it(campaign_run):
    from registry.db import RegistryDB
    from registry.gates import evaluate_gate, summarize
    from training.runtime.sinks import read_metrics

    out = campaign_run
    assert out.status == "finished", out.verdict
    db = RegistryDB()
    runs = {(r.stage, r.candidate): r for r in db.runs("refrun-1")}
    assert set(runs) == {("baseline", "default"), ("next", "reference-baseline"),
                         ("next", "full"), ("next", "half")}
    ref_row = runs[("next", "reference-baseline")]
    assert ref_row.status == "finished"
    ref = yaml.safe_load(db.get_recipe(ref_row.recipe_hash).yaml)
    base = yaml.safe_load(db.get_recipe(runs[("baseline", "default")].recipe_hash).yaml)
    # the baseline's promoted recipe, from this stage's starting checkpoint, at its data
    start = out.promoted["baseline"].checkpoint
    assert ref["model"] == {"kind": "checkpoint", "path": start, "moe_experts": 0,
                            "origin": f"recipe:{runs[('baseline', 'default')].recipe_hash}"}
    # the stage's overrides apply (its task and optimiser), its async section would not
    assert base["optim"]["lr"] != 2e-6
    assert ref["optim"]["lr"] == 2e-6
    assert ref["async"] == base["async"]
    assert ref["steps"] == 3  # ceil(48 / 16)
    ref_dir = Path(ref_row.run_dir)
    ref_summary = summarize(read_metrics(ref_dir / "metrics.jsonl"))
    original = summarize(read_metrics(Path(runs[("baseline", "default")].run_dir)
                                      / "metrics.jsonl"))
    for cand in ("full", "half"):
        report = json.loads((Path(runs[("next", cand)].run_dir) / "gate_report.json")
                            .read_text())
        judged = report["judged_with"]
        assert judged["references"] == {"baseline": ref_summary}
        assert judged["reference_runs"] == {"baseline": str(ref_dir)}
        # the recorded verdict is the gate on the re-run's summary
        gate = next(g for g in report["gates"] if g["name"] == "logprob_diff_flat")
        history = read_metrics(Path(runs[("next", cand)].run_dir) / "metrics.jsonl")
        again = evaluate_gate("logprob_diff_flat", history, {"max_ratio": 1000.0},
                              reference=ref_summary, context=judged["context"]).to_dict()
        assert (gate["threshold"], gate["evidence"]) == (again["threshold"], again["evidence"])
        assert gate["threshold"] is not None and gate["threshold"] > 0
    assert ref_summary != original  # a different start: a different reference
    # the reference is judged on the stage's absolute gates only, and never promoted
    ref_report = json.loads((ref_dir / "gate_report.json").read_text())
    assert [g["name"] for g in ref_report["gates"]] == ["reward_not_collapsed"]
    assert out.promoted["next"].candidate in ("full", "half")
    assert {p.candidate for p in db.promotions(campaign_id="refrun-1")} <= {
        "default", "full", "half"}
    db.close()


def test_candidates_of_a_stage_train_the_same_samples(campaign_run):
    from registry.db import RegistryDB

    db = RegistryDB()
    runs = {(r.stage, r.candidate): r for r in db.runs("refrun-1")}
    seen = {}
    for cand in ("full", "half", "reference-baseline"):
        row = runs[("next", cand)]
        recipe = yaml.safe_load(db.get_recipe(row.recipe_hash).yaml)
        report = json.loads((Path(row.run_dir) / "gate_report.json").read_text())
        seen[cand] = (recipe["steps"], report["samples_trained"])
    db.close()
    assert seen == {"full": (3, 48), "half": (6, 48), "reference-baseline": (3, 48)}


def test_mlflow_holds_the_reference_as_a_child_run(campaign_run):
    from mlflow import MlflowClient

    from flows.tracking import default_tracking_uri

    client = MlflowClient(tracking_uri=default_tracking_uri())
    exp = client.get_experiment_by_name("asyncrl/refrun")
    runs = client.search_runs([exp.experiment_id])
    by_cand = {r.data.tags.get("asyncrl.candidate"): r for r in runs
               if r.data.tags.get("mlflow.parentRunId")}
    assert set(by_cand) == {"default", "reference-baseline", "full", "half"}
    ref = by_cand["reference-baseline"]
    assert ref.info.status == "FINISHED"
    assert ref.data.tags["asyncrl.samples_trained"] == "48"
    assert ref.data.params["steps"] == "3"
