"""`seeds: k` (issue 26): a stage's candidates and its re-run reference train k seeds from the
same start, seed j judged against the reference's seed j; a candidate passes only when every seed
passes. Real stack (Prefect, Ray, embedded engines, MLflow, SQLite registry), tiny runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # a 7-run campaign (≈2 min)

TINY = yaml.safe_load((Path(__file__).parents[1] / "tiny-recipe.yaml").read_text())

CAMPAIGN = {
    "name": "seeds",
    "base": TINY,
    "stages": [
        {"name": "baseline", "seeds": 2, "gates": [{"name": "reward_not_collapsed"}]},
        {"name": "again", "steps": 2, "seeds": 2, "rerun_reference": True,
         "promotion": "best_eval",
         "candidates": [{"name": "a"}, {"name": "b", "seeds": 1,
                                        "overrides": {"optim": {"lr": 1e-5}}}],
         "gates": [{"name": "logprob_diff_flat", "relative_to": "baseline"}]},
    ],
}


@pytest.fixture(scope="module")
def seeded_run(tmp_path_factory, run_campaign):
    from flows.campaign import campaign_flow

    with run_campaign(tmp_path_factory, "seeds", CAMPAIGN) as (_, path):
        yield campaign_flow(str(path), "seeds-1")


def _runs():
    from registry.db import RegistryDB

    db = RegistryDB()
    try:
        return {(r.stage, r.candidate): (r, yaml.safe_load(db.get_recipe(r.recipe_hash).yaml))
                for r in db.runs("seeds-1")}
    finally:
        db.close()


def test_every_seed_runs_from_the_same_start_under_its_own_name(seeded_run):
    assert seeded_run.status == "finished", seeded_run.verdict
    runs = _runs()
    assert set(runs) == {("baseline", "default"), ("baseline", "default.s1"),
                         ("again", "reference-baseline"), ("again", "reference-baseline.s1"),
                         ("again", "a"), ("again", "a.s1"), ("again", "b")}
    (_, r0), (_, r1) = runs[("baseline", "default")], runs[("baseline", "default.s1")]
    assert (r0["seed"], r1["seed"]) == (0, 1)
    # seed 1 keeps seed 0's warm start: the same start, other RL randomness
    assert r0["model"]["seed"] is None and r1["model"]["seed"] == 0
    # a later stage starts from the promoted checkpoint at every seed
    (_, a0), (_, a1) = runs[("again", "a")], runs[("again", "a.s1")]
    assert a0["model"] == a1["model"] and a0["model"]["kind"] == "checkpoint"
    assert (a0["seed"], a1["seed"]) == (0, 1)


def test_seed_j_is_judged_against_the_reference_seed_j(seeded_run):
    runs = _runs()

    def judged(candidate):
        run = runs[("again", candidate)][0]
        return json.loads((Path(run.run_dir) / "gate_report.json").read_text())["judged_with"]

    ref_dir = {c: runs[("again", c)][0].run_dir
               for c in ("reference-baseline", "reference-baseline.s1")}
    assert judged("a")["reference_runs"] == {"baseline": ref_dir["reference-baseline"]}
    assert judged("a.s1")["reference_runs"] == {"baseline": ref_dir["reference-baseline.s1"]}
    assert judged("b")["reference_runs"] == {"baseline": ref_dir["reference-baseline"]}


def test_the_candidate_verdict_needs_every_seed_and_promotion_says_why(seeded_run):
    from registry.db import RegistryDB

    promoted = seeded_run.promoted["again"].candidate
    assert promoted in ("a", "b")
    db = RegistryDB()
    try:
        reason = next(p.reason for p in db.promotions(campaign_id="seeds-1")
                      if p.stage == "again")
        gates = {r.candidate: all(g.passed for g in db.gate_results(r.id))
                 for r in db.runs("seeds-1", "again")}
    finally:
        db.close()
    assert reason.startswith("best_eval: ") and "comparisons" in reason
    # the promoted candidate passed at every one of its seeds
    assert all(ok for name, ok in gates.items() if name.split(".s")[0] == promoted)
