"""Every shipped recipe (recipes/*.yaml) loads, validates and says what its file name says."""

from pathlib import Path

import pytest

from training.recipe import WarmStartModel, load_recipe, recipe_from_dict, recipe_hash

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
EXPECTED = {"sync", "one_step", "fully_async", "sync-moe", "one_step-moe", "fully_async-moe"}
FILES = sorted(RECIPES.glob("*.yaml"))
# the stress testbed (docs/findings/stress-testbed.md) has its own size and settings
STRESS = [p for p in FILES if p.stem.startswith("stress-")]
FILES = [p for p in FILES if p not in STRESS]


def test_the_six_recipes_exist():
    assert {p.stem for p in FILES} >= EXPECTED


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_recipe_loads_and_matches_its_file_name(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    mode = path.stem.removesuffix("-moe").removesuffix("-megatron").removesuffix("-tools")
    assert recipe.mode == mode
    # the -tools recipe runs the multi-turn tool task, every other one sum_digits
    assert recipe.task.name == ("calc_chain" if path.stem.endswith("-tools") else "sum_digits")
    assert isinstance(recipe.model, WarmStartModel)
    assert recipe.is_moe == path.stem.endswith("-moe")
    if recipe.is_moe:
        assert recipe.model.moe_experts > 0
    text = path.read_text()
    assert text.startswith("#"), "every recipe starts with a comment header saying what it is"
    assert "expect" in text.split("\nname:")[0], "the header says what to expect"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_recipe_round_trips_through_yaml(path, tmp_path):
    recipe = load_recipe(path)
    again = tmp_path / path.name
    again.write_text(recipe.to_yaml())
    reloaded = load_recipe(again)
    assert reloaded == recipe
    assert recipe_hash(reloaded) == recipe_hash(recipe) == load_recipe(path).hash()


def test_hashes_differ_across_recipes():
    hashes = {p.stem: load_recipe(p).hash() for p in FILES}
    assert len(set(hashes.values())) == len(hashes), hashes


def test_stage_specific_settings():
    r = {p.stem: load_recipe(p) for p in FILES}
    assert r["sync"].algorithm.old_logprob == "recompute"
    assert r["sync"].algorithm.correction.kind == "none"
    assert r["sync"].algorithm.advantage.estimator == "grpo"
    for name in ("one_step", "fully_async"):
        assert r[name].algorithm.old_logprob == "snapshot"
        assert r[name].algorithm.correction.kind == "compis"
        assert r[f"{name}-moe"].algorithm.routing_replay == "r3"
        assert r[name].algorithm.routing_replay == "none"
    assert r["sync-moe"].algorithm.routing_replay == "none"
    fa = r["fully_async"].async_
    assert (fa.staleness_threshold, fa.trigger_parameter_sync_step, fa.partial_rollout,
            fa.max_ahead_steps, fa.max_off_policy_steps) == (0.5, 1, True, 2, 4)
    assert (r["fully_async"].data.drain, r["fully_async"].data.dispatch) == (
        "windowed_fifo", "length_aware")


def test_moe_variant_differs_from_dense_only_in_model_and_replay():
    for mode in ("sync", "one_step", "fully_async"):
        dense = load_recipe(RECIPES / f"{mode}.yaml").to_dict()
        moe = load_recipe(RECIPES / f"{mode}-moe.yaml").to_dict()
        for d in (dense, moe):
            d.pop("name"), d.pop("description"), d.pop("model")
            d["algorithm"].pop("routing_replay")
        assert dense == moe, mode


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_recipes_are_small(path):
    """Sized for 20 steps in a few minutes on 2 CPU cores (see each header)."""
    r = load_recipe(path)
    assert r.steps == 20 and r.samples_per_step <= 64
    # a tool trajectory holds its calls, observations and answer: 41 tokens at most for calc_chain
    cap = 48 if path.stem.endswith("-tools") else 32
    assert r.rollout.max_response_tokens <= cap and r.engines.num_rollout_engines == 2
    assert (r.eval.every, r.eval.n) == (10, 64)
    assert recipe_from_dict(r.to_dict()).hash() == r.hash()


@pytest.mark.parametrize("path", STRESS, ids=lambda p: p.stem)
def test_stress_recipes_differ_from_stress_sync_only_in_their_pipeline(path):
    """The stress recipes are stress-sync.yaml with another async mode (and, fully async, the
    naive data pipeline): what they do beyond it is the pipeline's doing."""
    r = load_recipe(path)
    assert r.name == path.stem and r.mode == path.stem.removeprefix("stress-")
    assert r.is_moe and r.optim.epochs == 4 and r.algorithm.loss.clip_ratio_high == 0.28
    assert r.algorithm.correction.kind == "none" and path.read_text().startswith("#")
    base = load_recipe(RECIPES / "stress-sync.yaml").to_dict()
    d = r.to_dict()
    for x in (base, d):
        x.pop("name"), x.pop("description"), x.pop("async"), x.pop("data")
    assert d == base
