"""What a campaign file is refused for when it is loaded, before anything trains (issue 14), and
how a stage sizes its candidates: ``samples`` gives each candidate the same data, computed from
its own recipe; ``rerun_reference`` builds the re-run of a reference stage's promoted recipe.
Also through ``asyncrl validate``: the refusal is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from registry import gates
from registry.campaign import (
    CampaignError,
    StartingPoint,
    campaign_from_dict,
    load_campaign,
    stage_recipes,
)

# 16 samples a step: 4 prompts × 4 responses
TINY = yaml.safe_load((Path(__file__).parents[1] / "tiny-recipe.yaml").read_text())


def _load(stages: list[dict]) -> tuple:
    return campaign_from_dict({"name": "c", "base": TINY, "stages": stages}, "c.yaml")


def _refused(stages: list[dict]) -> str:
    with pytest.raises(CampaignError) as err:
        _load(stages)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_a_gate_listed_twice_is_refused():
    msg = _refused([{"name": "base", "gates": [
        {"name": "reward_not_collapsed"},
        {"name": "reward_not_collapsed", "params": {"drop": 0.9}}]}])
    assert msg == ("c.yaml: stages.0: stage 'base' lists gate 'reward_not_collapsed' 2 times; "
                   "list each gate once, with the params and relative_to you want")


def test_the_same_gate_in_two_stages_is_fine():
    campaign, _ = _load([{"name": "a", "gates": [{"name": "reward_not_collapsed"}]},
                         {"name": "b", "gates": [{"name": "reward_not_collapsed"}]}])
    assert [len(s.gates) for s in campaign.stages] == [1, 1]


def test_a_gate_the_candidate_cannot_feed_is_refused_naming_stage_gate_and_candidate():
    # the second candidate runs no evaluation, which eval_tracks_reward reads
    msg = _refused([{"name": "base", "gates": [{"name": "eval_tracks_reward"}],
                     "candidates": [{"name": "ok"},
                                    {"name": "blind", "overrides": {"eval": {"n": 0}}}]}])
    assert msg.startswith("c.yaml: stage 'base' gate 'eval_tracks_reward' cannot judge "
                          "candidate 'blind': ")
    # the reason is registry.gates' own, for that candidate's recipe
    from training.recipe import recipe_from_dict

    blind = recipe_from_dict({**TINY, "eval": {"every": 0, "n": 0}})
    why = gates.unmet_requirement("eval_tracks_reward", {}, blind)
    assert why and msg.endswith(why)
    assert gates.unmet_requirement("eval_tracks_reward", {}, recipe_from_dict(TINY)) is None
    # the same candidates under a gate they can feed load
    _load([{"name": "base", "gates": [{"name": "reward_not_collapsed"}],
            "candidates": [{"name": "ok"}, {"name": "blind", "overrides": {"eval": {"n": 0}}}]}])


def test_steps_and_samples_together_are_refused():
    msg = _refused([{"name": "base", "steps": 3, "samples": 64}])
    assert msg == ("c.yaml: stages.0: stage 'base' sets both steps (3) and samples (64); keep "
                   "one (samples: equal data per candidate, steps: equal steps)")


def test_samples_set_each_candidates_steps_from_its_own_batch():
    campaign, base = _load([{"name": "base", "samples": 100, "candidates": [
        {"name": "full"},                                                  # 4 × 4 = 16 a step
        {"name": "quarter", "overrides": {"rollout": {"batch_prompts": 1}}},  # 1 × 4 = 4
        {"name": "groups8", "overrides": {"rollout": {"n": 8}}},              # 4 × 8 = 32
        {"name": "big", "overrides": {"steps": 50}},  # the stage's samples win over steps
    ]}])
    built = stage_recipes(campaign, campaign.stages[0], base, {})
    got = {c.name: (r.samples_per_step, r.steps) for c, r in built.candidates}
    # ceil(100 / 16) = 7, ceil(100 / 4) = 25, ceil(100 / 32) = 4
    assert got == {"full": (16, 7), "quarter": (4, 25), "groups8": (32, 4), "big": (16, 7)}
    # the recorded recipe carries the steps
    assert built.candidates[1][1].to_dict()["steps"] == 25


def test_samples_that_need_too_many_steps_are_refused():
    msg = _refused([{"name": "base", "samples": 10**10}])
    assert msg == ("c.yaml: stage 'base' candidate 'default': samples=10000000000 at 16 samples "
                   "a step is 625000000 steps, above the limit 1000000; lower the stage's samples")


def test_the_next_stage_keeps_the_promoted_steps():
    campaign, base = _load([{"name": "a", "samples": 40},
                            {"name": "b", "overrides": {"rollout": {"batch_prompts": 2}}}])
    a = stage_recipes(campaign, campaign.stages[0], base, {})
    assert a.candidates[0][1].steps == 3  # ceil(40 / 16)
    b = stage_recipes(campaign, campaign.stages[1], a.candidates[0][1], {})
    assert b.candidates[0][1].steps == 3


REF_GATE = {"name": "logprob_diff_flat", "relative_to": "a", "params": {"max_ratio": 3.0}}


def test_rerun_reference_rebuilds_the_promoted_recipe_at_this_stages_start_and_length():
    campaign, base = _load([
        {"name": "a", "overrides": {"optim": {"lr": 3e-6}}},
        {"name": "b", "rerun_reference": True, "samples": 64,
         "overrides": {"async": {"mode": "one_step"}, "rollout": {"batch_prompts": 2}},
         "gates": [REF_GATE, {"name": "reward_not_collapsed"}]}])
    a = stage_recipes(campaign, campaign.stages[0], base, {})
    promoted = a.candidates[0][1]
    start = StartingPoint("/ckpt/a/final/hf", a.candidates[0][1])
    b = stage_recipes(campaign, campaign.stages[1], promoted, {"a": promoted}, start=start)
    ref = b.references["a"]
    assert list(b.references) == ["a"]
    assert ref.name == "c/b/reference-a"
    assert ref.model.model_dump() == {"kind": "checkpoint", "path": "/ckpt/a/final/hf",
                                      "origin": f"recipe:{a.candidates[0][1].hash()}",
                                      "moe_experts": 0}
    # the promoted recipe (sync, lr 3e-6) + the stage's non-async overrides (2 prompts × 4 =
    # 8 samples a step), at this stage's data: ceil(64 / 8) = 8 steps
    assert (ref.mode, ref.optim.lr, ref.samples_per_step, ref.steps) == ("sync", 3e-6, 8, 8)
    cand = b.candidates[0][1]
    assert (cand.mode, cand.samples_per_step, cand.steps) == ("one_step", 8, 8)
    # without rerun_reference nothing is re-run
    plain, _ = _load([{"name": "a"}, {"name": "b", "samples": 64, "gates": [REF_GATE]}])
    assert stage_recipes(plain, plain.stages[1], promoted, {"a": promoted}).references == {}


def test_rerun_reference_runs_the_stages_task_in_its_own_async_mode():
    # seed-ladder's context stage: longer responses, bigger groups, harder prompts — the
    # reference must run that task too, or the gates compare two different tasks
    task = {"rollout": {"max_response_tokens": 24, "n": 8},
            "task": {"difficulty_weights": {4: 1, 5: 2}}}
    for stage_async in ({"async": {"mode": "one_step"}}, {"async.mode": "one_step"}):
        campaign, base = _load([
            {"name": "a"},
            {"name": "b", "rerun_reference": True, "samples": 64,
             "overrides": {**task, **stage_async}, "gates": [REF_GATE]}])
        promoted = stage_recipes(campaign, campaign.stages[0], base, {}).candidates[0][1]
        b = stage_recipes(campaign, campaign.stages[1], promoted, {"a": promoted})
        ref, cand = b.references["a"], b.candidates[0][1]
        for r in (ref, cand):
            assert (r.rollout.max_response_tokens, r.rollout.n) == (24, 8)
            assert r.to_dict()["task"]["difficulty_weights"] == {"4": 1.0, "5": 2.0}
            assert r.samples_per_step == 32 and r.steps == 2  # 4 prompts × 8, ceil(64 / 32)
        assert (ref.mode, cand.mode) == ("sync", "one_step")
        assert promoted.rollout.max_response_tokens == 16  # the promoted recipe is unchanged


@pytest.mark.parametrize(("stage", "message"), [
    ({"rerun_reference": True, "steps": 2, "gates": [{"name": "reward_not_collapsed"}]},
     "stage 'b' sets rerun_reference but none of its gates has relative_to; give a gate "
     "relative_to: <earlier stage> or drop rerun_reference"),
    ({"rerun_reference": True, "gates": [REF_GATE]},
     "stage 'b' sets rerun_reference without steps or samples; set one so the reference trains "
     "as much as the candidates"),
    ({"rerun_reference": True, "steps": 2, "gates": [REF_GATE],
      "candidates": [{"name": "reference-a"}]},
     "stage 'b': candidate 'reference-a' has the name of the re-run of stage 'a' "
     "(rerun_reference); rename it"),
])
def test_rerun_reference_that_cannot_work_is_refused(stage, message):
    assert _refused([{"name": "a"}, {"name": "b", **stage}]) == f"c.yaml: stages.1: {message}"


def test_validate_and_load_show_the_refusal_in_one_line(tmp_path):
    from ui.cli import app

    path = tmp_path / "dup.yaml"
    path.write_text(yaml.safe_dump({"name": "dup", "base": TINY, "stages": [
        {"name": "s", "gates": [{"name": "grad_norm_no_spike"}, {"name": "grad_norm_no_spike"}]}
    ]}))
    res = CliRunner().invoke(app, ["validate", str(path)])
    assert res.exit_code == 1
    assert res.stderr == (f"error: {path}: stages.0: stage 's' lists gate 'grad_norm_no_spike' "
                          "2 times; list each gate once, with the params and relative_to you "
                          "want\n")
    with pytest.raises(CampaignError, match="lists gate 'grad_norm_no_spike' 2 times"):
        load_campaign(path)


def test_a_stages_recipes_have_the_same_identity_on_every_home_directory():
    """Issue 15: the recipe hash of a stage after the first counts where its checkpoint came
    from (the promoted recipe), not the absolute $ASYNCRL_HOME path, so the same ladder in two
    campaigns on two machines gives the same hashes and the registry stores each recipe once."""
    from training.recipe import recipe_from_dict

    campaign, base = _load([{"name": "a"}, {"name": "b", "overrides": {"optim": {"lr": 3e-6}}}])
    promoted = stage_recipes(campaign, campaign.stages[0], base, {}).candidates[0][1]
    hashes = set()
    for home in ("/home/alice/.asyncrl/campaigns/c-1", "/scratch/bob/asyncrl/campaigns/c-7"):
        start = StartingPoint(f"{home}/a/default/final/hf", promoted)
        recipe = stage_recipes(campaign, campaign.stages[1], promoted, {},
                               start=start).candidates[0][1]
        assert recipe.model.path == f"{home}/a/default/final/hf"  # the run reads this one
        hashes.add(recipe.hash())
    assert len(hashes) == 1
    # a different promoted recipe is a different start, whatever the path
    other = StartingPoint("/home/alice/.asyncrl/campaigns/c-1/a/default/final/hf",
                          recipe_from_dict({**promoted.to_dict(), "seed": 1}))
    assert stage_recipes(campaign, campaign.stages[1], promoted, {},
                         start=other).candidates[0][1].hash() not in hashes


# every candidate's and re-run reference's recipe hash of the shipped campaigns, along the chain
# where each stage promotes its last candidate: building stages from Recipe objects (not their
# dicts) and any later refactor must leave them as they were recorded (identity, resume)
SHIPPED_HASHES = {
    "quick.yaml": [
        ("baseline", {"default": "2f9a66a25541c6b0"}, {}),
        ("one-step", {"default": "f9e8a2df2af5fc71"}, {}),
        ("fully-async", {"default": "bd35409177a3d19e"}, {}),
        ("context", {"default": "7c5be2f826108c05"}, {}),
    ],
    "seed-ladder.yaml": [
        ("baseline", {"default": "b1c23c16fa2711ab"}, {}),
        ("one-step", {"no-correction": "4f9d03b97b4426a2", "r3": "54c9b2bb14caaa5c",
                      "r3-m2po": "686722d11609619b", "r3-dppo": "47e337d78d25a561",
                      "r3-compis": "ca8f9ad338b856b1", "r3-compis-icepop": "85e07e009d7e8f88"},
         {"baseline": "b1c23c16fa2711ab"}),
        ("fully-async", {"naive-fifo": "4b7e884e189259b3",
                         "wfifo-length-aware": "cddbf64849e34fc0"},
         {"baseline": "c82c4f1f494f67f2"}),
        ("context", {"grpo": "a97f643a38ef1cd6", "dr-grpo": "382de552b8490a2b",
                     "dr-grpo-icepop-fix3": "c1ac3c00d3ad907c"}, {"baseline": "5246b4d14ecec430"}),
    ],
    "tools.yaml": [
        ("baseline", {"default": "c5202e0c9090b671"}, {}),
        ("fully-async", {"default": "920b4dfc7ba4cce2"}, {}),
        ("turn-level", {"trajectory": "920b4dfc7ba4cce2", "turn-baseline": "19a5733fb724181c",
                        "turn-is": "524365aaf5082f2b"}, {}),
    ],
}


@pytest.mark.parametrize("name", sorted(SHIPPED_HASHES))
def test_the_shipped_campaigns_recipe_hashes_do_not_move(name):
    campaign, current = load_campaign(Path(__file__).parents[2] / "campaigns" / name)
    promoted = {}
    got = []
    for st in campaign.stages:
        built = stage_recipes(campaign, st, current, promoted)
        got.append((st.name, {c.name: r.hash() for c, r in built.candidates},
                    {k: r.hash() for k, r in built.references.items()}))
        current = promoted[st.name] = built.candidates[-1][1]
    assert got == SHIPPED_HASHES[name]
