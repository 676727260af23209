"""registry.remediation: which fix a failing run's diagnosis and failed gates propose, in what
order, and the recipe each makes — on the stress recipe and on the diagnosis of a real run
(the sweep's sync run at lr 1e-4, whose reward collapsed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from registry.gates.diagnosis import Prescribed, RunDiagnosis
from registry.remediation import FailedGate, apply_remedy, candidates, propose, remedy_name
from training.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
HISTORIES = Path(__file__).parent / "histories"


def _stress(**overrides):
    return load_recipe(ROOT / "recipes" / "stress-sync.yaml", overrides)


def _diagnosis(*findings: Prescribed) -> RunDiagnosis:
    return RunDiagnosis(causes=[f.cause for f in findings], findings=list(findings), notes=[],
                        unseparated=None, engine_exact=1.0, healthy=not findings,
                        escalation=None, escalation_text=None, missing=[], window=(0, 29),
                        failed_gates=[], skipped_gates=[], summary="test")


def test_the_tree_first_then_the_gates_symptoms_then_seed_000() -> None:
    recipe = _stress()
    tree = Prescribed(cause="B", title="policy staleness", evidence=["ess 0.4 < 0.5"],
                      fix="…", override={"algorithm.old_logprob": "snapshot"})
    info = Prescribed(cause="C", title="drift", evidence=[], fix="", override={"x": 1},
                      info=True)
    failed = [FailedGate("reward_not_collapsed", "fell 43%"),
              FailedGate("no_length_surge", "length ×1.4")]
    got = candidates(_diagnosis(tree, info), failed, recipe)
    # the tree's cause, then the symptom's own cause (F for a length surge), then seed 000
    assert [r.key for r in got] == ["seed001:B", "seed001:F", "seed000:fix1", "seed000:fix3"]
    assert got[0].source == "seed 001's decision tree on the run"
    # F from the failed gate, tailored to the recipe: half its LR, the guard, geo-RS bypass
    assert got[1].override["optim.lr"] == pytest.approx(3e-5)
    assert got[1].override["optim.length_surge_guard"] == {}
    assert got[1].source == "seed 001 for the failed gate no_length_surge (cause F)"
    assert got[1].evidence == ("length ×1.4",)
    assert got[2].override == {"algorithm.advantage.norm_by_std": False,
                               "algorithm.loss.agg": "seq-mean-token-sum-norm"}
    assert got[3].override == {"optim.epochs": 1, "rollout.batch_prompts": 2}


def test_fixes_that_do_not_apply_are_not_proposed() -> None:
    recipe = _stress(**{"optim.epochs": 1, "algorithm.advantage.norm_by_std": False})
    got = candidates(None, [FailedGate("entropy_no_blowup", "")], recipe)
    assert got == []  # Dr.GRPO already, one epoch already


def test_propose_skips_what_was_tried_and_what_changes_nothing() -> None:
    recipe = _stress(**{"optim.lr": 1e-4})
    failed = [FailedGate("reward_not_collapsed", "fell")]
    first, r1 = propose(None, failed, recipe)
    assert first.key == "seed000:fix1" and r1.algorithm.advantage.norm_by_std is False
    second, r2 = propose(None, failed, r1, tried=[first.key])
    assert second.key == "seed000:fix3"
    # 1 epoch on ¼-size batches trains the same samples: 4× the steps
    assert (r2.optim.epochs, r2.rollout.batch_prompts) == (1, 2)
    assert r2.steps * r2.samples_per_step == recipe.steps * recipe.samples_per_step
    assert propose(None, failed, r2, tried=[first.key, second.key]) is None


def test_an_override_that_does_not_load_is_skipped_with_its_reason() -> None:
    recipe = _stress()
    bad = Prescribed(cause="D", title="IS variance", evidence=[], fix="",
                     override={"algorithm.correction": {"kind": "preset", "name": "nope"}})
    remedy, _ = propose(_diagnosis(bad), [FailedGate("eval_not_degraded", "")], recipe)
    assert remedy.key == "seed000:fix1"
    assert len(remedy.skipped) == 1 and remedy.skipped[0].startswith("seed001:D: ")


def test_the_real_collapsed_run_gets_a_remedy() -> None:
    """The sweep's sync run at lr 1e-4 (reward fell 43 % of its peak): the tree names no cause,
    its failed gates propose the length surge's own fix first (seed 001 F), on its own
    recipe."""
    import yaml

    from registry.gates import diagnosis_for, evaluate_gates
    from training.recipe import recipe_from_dict
    from training.runtime.sinks import read_metrics

    history = read_metrics(HISTORIES / "sync-1e4.jsonl")
    recipe = recipe_from_dict(yaml.safe_load((HISTORIES / "sync-1e4.recipe.yaml").read_text()))
    diagnosis = diagnosis_for(history, recipe)
    assert diagnosis.causes == []
    results = evaluate_gates([("reward_not_collapsed", {}), ("no_length_surge", {})], history)
    failed = [FailedGate(g.name, g.evidence) for g in results if not g.passed]
    assert [g.name for g in failed] == ["reward_not_collapsed", "no_length_surge"]
    remedy, fixed = propose(diagnosis, failed, recipe)
    assert remedy.key == "seed001:F"
    assert json.dumps(remedy.to_dict())  # what the registry stores
    assert fixed.optim.lr == pytest.approx(recipe.optim.lr / 2)
    assert fixed.algorithm.correction.name == "bypass_pg_geo_rs"
    assert apply_remedy(recipe, remedy.override, "replay").hash() == fixed.hash()


def test_remedy_names_and_the_campaign_schema() -> None:
    from registry.campaign import Stage

    assert remedy_name(2) == "remedy-2"
    s = Stage.model_validate({"name": "s", "gates": [{"name": "reward_not_collapsed"}],
                              "remediate": {}})
    assert s.remediate.max_attempts == 2
    with pytest.raises(ValueError, match="has no gates"):
        Stage.model_validate({"name": "s", "remediate": {}})
    with pytest.raises(ValueError, match="starts with 'remedy-'"):
        Stage.model_validate({"name": "s", "gates": [{"name": "reward_not_collapsed"}],
                              "candidates": [{"name": "remedy-1"}], "remediate": {}})
    with pytest.raises(ValueError, match="less than or equal to 5"):
        Stage.model_validate({"name": "s", "gates": [{"name": "reward_not_collapsed"}],
                              "remediate": {"max_attempts": 6}})


def test_the_champion_policy() -> None:
    from registry.campaign import Campaign

    data = {"name": "c", "base": "r.yaml", "stages": [{"name": "a"}, {"name": "b"}]}
    newest = Campaign.model_validate(data)
    assert newest.champion == "newest"
    assert newest.champion_moves("a") and newest.champion_moves("b")
    final = Campaign.model_validate({**data, "champion": "final"})
    assert not final.champion_moves("a") and final.champion_moves("b")
    with pytest.raises(ValueError, match="champion"):
        Campaign.model_validate({**data, "champion": "best"})
