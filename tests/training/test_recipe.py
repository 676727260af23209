import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.algorithms.decision_tree import prescription
from training.algorithms.policy_loss import POLICY_LOSSES
from training.recipe import (
    CompISCorrection,
    Recipe,
    RecipeError,
    apply_overrides,
    load_recipe,
    recipe_from_dict,
    recipe_hash,
    recipe_json_schema,
)


def _error(data) -> str:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def _write(tmp_path, text: str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# --- defaults ------------------------------------------------------------------------------------


def test_defaults_are_valid(tmp_path):
    r = Recipe()
    assert r.mode == "sync" and not r.is_moe
    assert r.samples_per_step == r.rollout.n * r.rollout.batch_prompts * r.async_.require_batches
    assert recipe_from_dict({}) == r
    assert load_recipe(_write(tmp_path, "{}\n")) == r  # explicit: all defaults
    assert r.to_dict()["async"]["mode"] == "sync"  # the YAML key is `async`, not `async_`


# --- one-line errors that name the field ---------------------------------------------------


def test_unknown_field():
    msg = _error({"rollout": {"nn": 4}})
    assert msg.startswith("recipe: rollout.nn: unknown field")
    assert "asyncrl schema recipe" in msg
    assert _error({"bogus": 1}).startswith("recipe: bogus: unknown field")


def test_unknown_loss_lists_valid_names():
    msg = _error({"algorithm": {"loss": {"name": "ppo2"}}})
    assert "algorithm.loss.name" in msg and "'ppo2'" in msg
    assert ", ".join(POLICY_LOSSES.names()) in msg


def test_unknown_advantage_and_task_and_preset():
    msg = _error({"algorithm": {"advantage": {"estimator": "x"}}})
    assert "algorithm.advantage.estimator" in msg
    assert "sum_digits" in _error({"task": {"name": "nope"}})
    msg = _error({"algorithm": {"correction": {"kind": "preset", "name": "zzz"}}})
    assert "algorithm.correction.name" in msg and "decoupled_token_is" in msg


def test_negative_staleness_threshold():
    msg = _error({"async": {"mode": "fully_async", "staleness_threshold": -0.5}})
    assert msg.startswith("recipe: async.staleness_threshold:")  # no union tag in the path
    assert "greater than or equal to 0" in msg


def test_fully_async_knob_on_sync_mode():
    msg = _error({"async": {"mode": "sync", "staleness_threshold": 0.5}})
    assert "async.staleness_threshold: unknown field" in msg


def test_bad_and_missing_discriminator():
    msg = _error({"async": {"mode": "turbo"}})
    assert "async" in msg and "'turbo'" in msg and "fully_async" in msg
    msg = _error({"async": {"require_batches": 2}})
    assert msg == "recipe: async: missing `mode`; add mode: one of sync, one_step, fully_async"
    msg = _error({"algorithm": {"correction": {"staleness": {"method": "cap"}}}})
    assert "algorithm.correction: missing `kind`" in msg and "compis" in msg


def test_icepop_lower_above_upper():
    msg = _error({"algorithm": {"correction": {
        "kind": "compis", "engine": {"method": "icepop", "lower": 3.0, "upper": 1.0}}}})
    assert msg == "recipe: algorithm.correction.engine: lower 3.0 > upper 1.0; swap them"


def test_routing_replay_needs_moe():
    msg = _error({"algorithm": {"routing_replay": "r3"}})
    assert "algorithm.routing_replay=r3" in msg and "model.moe_experts" in msg
    ok = recipe_from_dict({"model": {"kind": "warmstart", "moe_experts": 4},
                           "algorithm": {"routing_replay": "r3"}})
    assert ok.is_moe and ok.algorithm.routing_replay == "r3"


def test_other_cross_field_rules():
    msg = _error({"model": {"kind": "warmstart", "moe_experts": 2, "moe_top_k": 4}})
    assert msg.startswith("recipe: model: moe_top_k=4 exceeds moe_experts=2")
    assert "raise it" in _error({"data": {"max_in_flight": 4}})
    assert "old_logprob: bypass" in _error(
        {"algorithm": {"old_logprob": "bypass", "correction": {"kind": "compis"}}})
    assert "model.path" in _error({"model": {"kind": "checkpoint"}})


def test_many_errors_are_summarised_on_one_line():
    msg = _error({"rollout": {"n": 0, "batch_prompts": 0, "temperature": 0, "top_p": 2}})
    assert "rollout.n" in msg and msg.endswith("(+1 more)")


def test_not_a_mapping():
    assert "mapping of sections" in _error([1, 2])


def test_malformed_yaml_names_the_line(tmp_path):
    path = _write(tmp_path, "name: x\nrollout:\n  n: [1, 2\nsteps: 3\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and "line 4" in msg and "not valid YAML" in msg


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml", {"optim.lr": 1e-3})


def test_file_errors_name_the_file(tmp_path):
    path = _write(tmp_path, "rollout:\n  n: -1\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: rollout\.n:"):
        load_recipe(path)


# --- overrides -----------------------------------------------------------------------------------


def test_overrides_with_dotted_keys(tmp_path):
    path = _write(tmp_path, "name: base\nrollout:\n  n: 8\n  temperature: 0.7\n")
    r = load_recipe(path, {"optim.lr": 1e-4, "rollout.n": 4, "eval": {"every": 5}})
    assert r.optim.lr == 1e-4 and r.rollout.n == 4
    assert r.rollout.temperature == 0.7  # siblings of an overridden key stay
    assert r.eval.every == 5 and r.eval.n == 64


def test_overrides_do_not_mutate_their_input():
    data = {"rollout": {"n": 8}}
    out = apply_overrides(data, {"rollout.n": 2, "optim.lr": 0.01})
    assert data == {"rollout": {"n": 8}}
    assert out == {"rollout": {"n": 2}, "optim": {"lr": 0.01}}


def test_override_switches_the_async_variant(tmp_path):
    path = _write(tmp_path, "async:\n  mode: sync\n  require_batches: 2\n")
    r = load_recipe(path, {"async": {"mode": "fully_async"}})
    assert r.mode == "fully_async"
    assert r.async_.staleness_threshold == 0.5 and r.async_.require_batches == 1  # new variant
    r = load_recipe(path, {"async": {"mode": "fully_async", "staleness_threshold": 0.25}})
    assert r.async_.staleness_threshold == 0.25
    r = load_recipe(path, {"async.mode": "one_step"})  # dotted: only the tag changes
    assert r.mode == "one_step" and r.async_.require_batches == 2

    back = _write(tmp_path, "async:\n  mode: fully_async\n  staleness_threshold: 0.3\n", "fa.yaml")
    r = load_recipe(back, {"async": {"mode": "sync"}})  # fully_async-only knobs are dropped
    assert r.mode == "sync"


def test_a_mode_key_outside_a_variant_union_merges_like_any_field():
    """``algorithm.kl.mode`` is an ordinary field, not a union tag: the nested spelling keeps the
    base estimator and coefficient exactly as the dotted one does."""
    base = {"algorithm": {"kl": {"mode": "none", "estimator": "k3", "coef": 0.05}}}  # to_dict
    nested = recipe_from_dict(apply_overrides(base, {"algorithm": {"kl": {"mode": "in_reward"}}}))
    dotted = recipe_from_dict(apply_overrides(base, {"algorithm.kl.mode": "in_reward"}))
    for r in (nested, dotted):
        assert (r.algorithm.kl.mode, r.algorithm.kl.estimator, r.algorithm.kl.coef) == (
            "in_reward", "k3", 0.05)
    assert nested.hash() == dotted.hash()


def test_the_variant_unions_are_the_schemas():
    from training.recipe import variant_unions

    unions = variant_unions()
    assert {p: u[0] for p, u in unions.items()} == {
        "model": "kind", "async": "mode", "algorithm.correction": "kind"}
    assert set(unions["async"][1]) == {"sync", "one_step", "fully_async"}
    assert "staleness_threshold" in unions["async"][1]["fully_async"]
    assert "staleness_threshold" not in unions["async"][1]["one_step"]


def test_a_dotted_tag_switch_drops_what_the_new_variant_refuses(tmp_path):
    path = _write(tmp_path, "async:\n  mode: fully_async\n  staleness_threshold: 0.3\n"
                  "  require_batches: 2\n")
    r = load_recipe(path, {"async.mode": "one_step"})  # no 'staleness_threshold' error
    assert (r.mode, r.async_.require_batches) == ("one_step", 2)
    r = load_recipe(path, {"async.mode": "fully_async"})  # same tag: nothing dropped
    assert r.async_.staleness_threshold == 0.3
    with pytest.raises(RecipeError, match="async"):  # a mapping as the tag: one line, no crash
        load_recipe(path, {"async.mode": {"x": 1}})


def test_override_switches_the_correction_variant():
    base = {"algorithm": {"correction": {"kind": "preset", "name": "decoupled_token_is"}}}
    r = recipe_from_dict(apply_overrides(base, {"algorithm": {"correction": {"kind": "compis"}}}))
    assert isinstance(r.algorithm.correction, CompISCorrection)
    # seed 000's default CompIS: staleness cap 5, engine measured only (Fix 2's IcePop is explicit)
    assert r.algorithm.correction.staleness.method == "cap"
    assert r.algorithm.correction.engine.method == "none"


def test_a_prescribed_preset_replaces_the_old_presets_args(tmp_path):
    """Seed 001's fix for cause B names another preset with its own args: the old preset's args
    do not carry over into it (decoupled_geo_rs_seq_tis has no argument threshold)."""
    path = _write(tmp_path, "algorithm:\n  correction:\n    kind: preset\n"
                  "    name: decoupled_token_is\n    args: {threshold: 3}\n")
    r = load_recipe(path, prescription("B"))
    c = r.algorithm.correction
    assert c.name == "decoupled_geo_rs_seq_tis"
    assert c.args == {"is_threshold": 2.0, "rs_threshold": "0.99_1.01"}
    # a new name without args: the new preset's defaults
    r = load_recipe(path, {"algorithm": {"correction": {"name": "decoupled_geo_rs"}}})
    assert r.algorithm.correction.name == "decoupled_geo_rs" and r.algorithm.correction.args == {}
    # the same name: args still merge key by key
    r = load_recipe(path, {"algorithm": {"correction": {"name": "decoupled_token_is"}}})
    assert r.algorithm.correction.args == {"threshold": 3}
    two = _write(tmp_path, "algorithm:\n  correction:\n    kind: preset\n"
                 "    name: decoupled_geo_rs_seq_tis\n    args: {is_threshold: 3}\n", "two.yaml")
    r = load_recipe(two, {"algorithm.correction": {"args": {"rs_threshold": "0.9_1.1"}}})
    assert r.algorithm.correction.args == {"is_threshold": 3, "rs_threshold": "0.9_1.1"}


# --- hashing -------------------------------------------------------------------------------------


def test_hash_ignores_labels_and_field_order(tmp_path):
    a = _write(tmp_path, "name: a\ndescription: one\nsteps: 30\noptim:\n  lr: 0.001\n"
               "  epochs: 2\n", "a.yaml")
    b = _write(tmp_path, "optim:\n  epochs: 2\n  lr: 0.001\nsteps: 30\nname: b\n", "b.yaml")
    ra, rb = load_recipe(a), load_recipe(b)
    assert ra.name != rb.name and recipe_hash(ra) == recipe_hash(rb) == ra.hash()
    assert len(ra.hash()) == 16 and int(ra.hash(), 16) >= 0
    assert recipe_hash(load_recipe(a, {"optim.lr": 0.002})) != ra.hash()


def test_hash_counts_defaults_the_same_as_explicit_values():
    assert recipe_from_dict({"rollout": {"n": 8}}).hash() == Recipe().hash()
    assert recipe_from_dict({"rollout": {"n": 4}}).hash() != Recipe().hash()


def test_hash_is_stable_across_processes():
    import subprocess
    import sys

    code = "from training.recipe import Recipe; print(Recipe().hash())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == Recipe().hash()


def test_yaml_round_trip(tmp_path):
    r = recipe_from_dict({"name": "x", "model": {"kind": "warmstart", "moe_experts": 4},
                          "async": {"mode": "fully_async", "max_ahead_steps": 2},
                          "algorithm": {"routing_replay": "r2", "correction": {"kind": "compis"},
                                        "m2po": {"threshold": 0.05}},
                          "task": {"difficulty_weights": {1: 3.0, 8: 1.0}}})
    assert yaml.safe_load(r.to_yaml())["async"]["mode"] == "fully_async"
    again = load_recipe(_write(tmp_path, r.to_yaml()))
    assert again == r and again.hash() == r.hash()


# --- JSON schema ---------------------------------------------------------------------------------


def _objects(schema):
    yield "Recipe", schema
    yield from schema.get("$defs", {}).items()


def test_json_schema_is_valid_json_with_every_section():
    schema = json.loads(json.dumps(recipe_json_schema()))
    assert schema["type"] == "object"
    for section in ("model", "engines", "task", "rollout", "async", "data", "algorithm", "optim",
                    "eval", "steps", "seed"):
        assert section in schema["properties"], section
    assert "async_" not in schema["properties"]
    assert schema["properties"]["async"]["discriminator"]["propertyName"] == "mode"


def test_every_field_has_a_description():
    missing = [f"{name}.{field}" for name, obj in _objects(recipe_json_schema())
               for field, prop in obj.get("properties", {}).items()
               if not prop.get("description")]
    assert missing == []


@pytest.mark.parametrize("overrides,fragment", [
    ({"engines": {"rollout": "sglang", "sglang": {"router": "sglang-router"}},
      "model": {"kind": "warmstart", "moe_experts": 4}, "algorithm": {"routing_replay": "r3"}},
     "sglang-router drops return_routed_experts"),
    ({"engines": {"rollout": "sglang", "sglang": {"weight_sync": "nccl"}}},
     "weight_sync=nccl broadcasts from the Megatron ranks"),
    ({"engines": {"train": "megatron", "megatron": {"expert_parallel": 2}}},
     "expert_parallel=2 needs an MoE model"),
    ({"engines": {"train": "megatron", "megatron": {"expert_parallel": 2}},
      "model": {"kind": "warmstart", "moe_experts": 4}},
     "must divide data_parallel=1 (experts are split over the data-parallel ranks)"),
    ({"engines": {"train": "megatron", "megatron": {"pipeline_parallel": 3}}},
     "pipeline_parallel=3 must divide model.num_layers=4"),
    ({"engines": {"train": "megatron", "megatron": {"tensor_parallel": 2}},
      "model": {"kind": "warmstart", "moe_experts": 4}},
     "tensor_parallel=2 with an MoE model"),
    ({"engines": {"train": "megatron", "megatron": {"expert_parallel": 2, "data_parallel": 2}},
      "model": {"kind": "warmstart", "moe_experts": 3}},
     "must divide model.moe_experts=3"),
])
def test_backend_combinations_rejected(overrides, fragment) -> None:
    with pytest.raises(RecipeError, match=re.escape(fragment)):
        recipe_from_dict(overrides)


def test_unused_backend_settings_do_not_change_the_hash() -> None:
    plain = recipe_from_dict({})
    tuned = recipe_from_dict({"engines": {"megatron": {"tensor_parallel": 4},
                                          "sglang": {"tp_size": 8}}})
    assert plain.hash() == tuned.hash()
    used = recipe_from_dict({"engines": {"train": "megatron",
                                         "megatron": {"tensor_parallel": 4}}})
    assert used.hash() != recipe_from_dict({"engines": {"train": "megatron"}}).hash()
    # the megatron precision likewise: it counts only when train: megatron
    assert recipe_from_dict({"engines": {"megatron": {"precision": "bf16"}}}).hash() == plain.hash()
    megatron = recipe_from_dict({"engines": {"train": "megatron"}})
    bf16 = recipe_from_dict({"engines": {"train": "megatron", "megatron": {"precision": "bf16"}}})
    assert bf16.engines.megatron.precision == "bf16" and bf16.hash() != megatron.hash()
    assert recipe_from_dict({"engines": {"train": "megatron", "megatron": {
        "precision": "fp32"}}}).hash() == megatron.hash()
    # at its default the later field leaves the hash as it was before it existed (recorded with
    # the previous asyncrl), so such runs and campaigns still resume
    assert megatron.hash() == "7ba02de0f8bd0b82"


def test_megatron_precision_is_fp32_or_bf16() -> None:
    assert Recipe().engines.megatron.precision == "fp32"
    with pytest.raises(RecipeError, match=re.escape(
            "engines.megatron.precision: Input should be 'fp32' or 'bf16'")):
        recipe_from_dict({"engines": {"train": "megatron", "megatron": {"precision": "fp16"}}})


def test_partial_rollout_interrupt_resolves_per_backend() -> None:
    fully = {"async": {"mode": "fully_async"}}
    assert recipe_from_dict(fully).partial_interrupt == "retract"
    assert recipe_from_dict({**fully, "engines": {"rollout": "sglang"}}).partial_interrupt \
        == "abort_resume"
    assert recipe_from_dict({"async": {"mode": "fully_async", "interrupt": "abort_resume"}}) \
        .partial_interrupt == "abort_resume"
    assert recipe_from_dict({"async": {"mode": "fully_async", "partial_rollout": False}}) \
        .partial_interrupt is None
    assert recipe_from_dict({}).partial_interrupt is None  # sync: nothing is interrupted
    # SGLang's retract can be chosen (0.5.23 reports each token's version as spans)
    assert recipe_from_dict({"engines": {"rollout": "sglang"}, "async": {
        "mode": "fully_async", "interrupt": "retract"}}).partial_interrupt == "retract"
    # added later: at its default the hash is the one recorded before the field existed
    assert recipe_from_dict(fully).hash() == "1bc84c2c57424855"
    assert recipe_from_dict({"async": {"mode": "fully_async", "interrupt": "auto"}}).hash() \
        == "1bc84c2c57424855"
    assert recipe_from_dict({"async": {"mode": "fully_async", "interrupt": "retract"}}).hash() \
        != "1bc84c2c57424855"


# --- hostile input (issue 13) --------------------------------------------------------------------

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_shipped_recipe_hashes_are_unchanged():
    """Validation changes must not move a recipe's identity (recorded runs resume by it)."""
    assert {p.stem: load_recipe(p).hash() for p in sorted(RECIPES.glob("*.yaml"))} == {
        "fully_async-moe": "96211469d169d5e5", "fully_async": "f753da09696f08ce",
        "one_step-moe": "ba1800e260e9380c", "one_step": "6515d15c4a52cfde",
        "sync-megatron": "c07036e23d5d3aa0", "sync-moe": "c91587d3d0f1a85b",
        "sync": "d4380df48cc2e5a5", "stress-fully_async": "3ee20f243061f8c2",
        "stress-one_step": "537f58661b6ffbf8", "stress-sync": "8b1fc2cb22d5851a",
        "fully_async-tools": "dde3b18ecc00433a"}
    assert Recipe().hash() == "ea36c3d781b604d7"


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n", "null\n"])
def test_an_empty_recipe_file_is_an_error(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value) == (
        f"{path}: the file is empty (no YAML value, only comments or blank lines); write the "
        "recipe in it, or pass the path of a YAML recipe (see recipes/)")


def test_the_registries_hold_exactly_the_names_recipes_are_checked_against():
    """training.algorithms.names (torch-free, what a recipe is checked against) and the
    registries cannot drift: each registry requires its list when its module loads."""
    from training.algorithms import names
    from training.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from training.algorithms.kl import KL_ESTIMATORS
    from training.algorithms.policy_loss import LOSS_AGG_MODES, POLICY_LOSSES
    from training.algorithms.registry import Registry
    from training.algorithms.rollout_correction import PRESETS
    from training.tasks.registry import task_names

    assert set(POLICY_LOSSES.names()) == names.POLICY_LOSSES
    assert set(ADVANTAGE_ESTIMATORS.names()) == names.ADVANTAGE_ESTIMATORS
    assert set(KL_ESTIMATORS.names()) == names.KL_ESTIMATORS
    assert LOSS_AGG_MODES == names.LOSS_AGG_MODES and tuple(PRESETS) == names.PRESETS
    assert set(task_names()) == names.TASKS
    r: Registry = Registry("policy loss")
    r.register("vanilla")(len)
    r.register("mine")(len)
    with pytest.raises(RuntimeError) as info:
        r.require({"vanilla", "gspo"})
    assert str(info.value) == (
        "policy loss registry and training.algorithms.names disagree: listed but not "
        "registered ['gspo'], registered but not listed ['mine']; register the function and "
        "list its name in training.algorithms.names")


def test_checking_a_recipe_of_known_names_imports_no_torch():
    code = ("import sys; from training.recipe import load_recipe; "
            "[load_recipe(p) for p in sys.argv[1:]]; "
            "print(sorted(m for m in ('torch', 'numpy', 'ray', 'prefect', 'mlflow') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *map(str, RECIPES.glob("*.yaml"))],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _integer_properties(schema):
    for name, obj in _objects(schema):
        for field, prop in obj.get("properties", {}).items():
            arms = prop.get("anyOf", [prop])
            for arm in arms:
                if arm.get("type") == "integer":
                    yield f"{name}.{field}", arm


def test_every_integer_field_has_an_upper_bound():
    ints = dict(_integer_properties(recipe_json_schema()))
    assert len(ints) > 30
    assert [k for k, prop in ints.items() if "maximum" not in prop] == []
    assert ints["Recipe.seed"]["maximum"] == 2**31 - 1  # seed + engine index seeds numpy (< 2**32)


@pytest.mark.parametrize(("data", "message"), [
    ({"seed": 10**32}, "recipe: seed: Input should be less than or equal to 2147483647"),
    ({"seed": 2.0**40}, "recipe: seed: Input should be less than or equal to 2147483647"),
    ({"rollout": {"n": True}}, "recipe: rollout.n: must be a number, got true"),
    ({"rollout": {"n": "yes"}}, "recipe: rollout.n: Input should be a valid integer, unable to "
     "parse string as an integer"),
    ({"async": {"mode": "fully_async", "partial_rollout": "on"}},
     "recipe: async.partial_rollout: must be true or false, got the string 'on'"),
    ({"optim": {"grad_clip": float("inf")}},
     "recipe: optim.grad_clip: must be a finite number (not .inf or .nan)"),
    ({"optim": {"lr": float("nan")}}, "recipe: optim.lr: must be a finite number (not .inf or "
     ".nan)"),
    ({"rollout": 5}, "recipe: rollout: must be a mapping, got the number 5"),
    ({"task": {"difficulty_weights": {10**7: 1}}},
     "recipe: task.difficulty_weights: difficulty buckets are integers in [-1,000,000, "
     "1,000,000]"),
    ({"task": {"args": {"when": datetime.date(2024, 1, 1)}}},
     "recipe: task.args: when: a date value is not allowed (only strings, numbers, true/false, "
     "null, lists and mappings)"),
    ({"model": {"kind": "checkpoint", "path": "ckpt\x00"}},
     "recipe: model.path: checkpoint path 'ckpt\\x00' contains a control character; remove it"),
    ({"rollout": {"n\x1b[2J\nx": 1}}, "recipe: rollout.n\\x1b[2J\\nx: unknown field; remove it "
     "or check its spelling (asyncrl schema recipe lists them)"),
])
def test_hostile_values_are_one_line(data, message):
    assert _error(data) == message


@pytest.mark.parametrize("name", ["../../../escaped/run", "/abs", "a/../../b", ".hidden", "..",
                                  "a b", "a\n", "a/b/c/d", "x" * 65, "", "a//b", "run/"])
def test_a_name_that_could_leave_the_runs_directory_is_refused(name):
    msg = _error({"name": name})
    assert msg.startswith("recipe: name: ")
    assert "(it names the run directory)" in msg or "at least 1 character" in msg


@pytest.mark.parametrize("name", ["sync", "fully_async-moe", "v1.2", "quick/baseline/default",
                                  "a/b"])
def test_names_of_recipes_and_campaign_candidates_are_accepted(name):
    assert recipe_from_dict({"name": name}).name == name


def test_task_args_refuse_cycles_and_bombs():
    cycle: dict = {}
    cycle["self"] = cycle
    assert "contains itself (a cycle)" in _error({"task": {"args": cycle}})
    level: list = [1] * 10
    for _ in range(7):
        level = [level] * 10
    assert "holds more than 100,000 values" in _error({"task": {"args": {"x": level}}})


def test_overrides_are_copied_as_plain_data_not_through_json():
    base = {"task": {"difficulty_weights": {"4": 2.0}}}
    out = apply_overrides(base, {"task": {"difficulty_weights": {4: 1, 5: 1}}})
    assert out == {"task": {"difficulty_weights": {"4": 1, "5": 1}}}  # keys as JSON made them
    assert base == {"task": {"difficulty_weights": {"4": 2.0}}}
    with pytest.raises(RecipeError) as info:
        apply_overrides({}, {"task": {"args": {"d": datetime.date(2024, 1, 1)}}})
    assert str(info.value) == ("overrides: task.args.d: a date value is not allowed (only "
                               "strings, numbers, true/false, null, lists and mappings)")
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(RecipeError, match=r"^overrides: x\.0: contains itself"):
        apply_overrides({}, {"x": cycle})
    level: list = ["lol"] * 10
    for _ in range(9):
        level = [level] * 10
    with pytest.raises(RecipeError, match="holds more than 100,000 values"):
        apply_overrides({}, {"task.args.x": level})


def test_a_yaml_recipe_with_aliases_dates_or_big_numbers_is_one_line(tmp_path):
    cases = {
        "task:\n  args: &a {x: 1}\nrollout: *a\n": "line 3, column 10: an alias (*name) is not "
        "allowed",
        "seed: 2024-13-45\n": "seed: Input should be a valid integer",
        "seed: " + "1" * 5000 + "\n": "line 1, column 7: an integer of 5000 characters is too "
        "large",
        "rollout:\n  n: yes\n": "rollout.n: Input should be a valid integer",
        "eval:\n  every: 1.0e+400\n": "eval.every: must be a finite number",
    }
    for text, needle in cases.items():
        path = _write(tmp_path, text)
        with pytest.raises(RecipeError) as info:
            load_recipe(path)
        msg = str(info.value)
        assert msg.startswith(f"{path}: ") and needle in msg and "\n" not in msg, (text, msg)


def test_a_mapping_override_never_hides_a_scalar_given_before_it():
    """A stage's `algorithm: 5` followed by a candidate's `algorithm: {...}` is an error, not a
    silently valid recipe; null (an optional section switched off) still takes a mapping."""
    staged = apply_overrides({}, {"algorithm": 5})
    with pytest.raises(RecipeError) as info:
        apply_overrides(staged, {"algorithm": {"routing_replay": "none"}})
    assert str(info.value) == ("overrides: algorithm is the number 5 (in the recipe or an earlier "
                               "override), so a mapping cannot be merged into it; make it a "
                               "mapping")
    with pytest.raises(RecipeError, match=r"^overrides: algorithm\.loss is the string 'x'"):
        apply_overrides({"algorithm": {"loss": "x"}}, {"algorithm.loss.name": "vanilla"})
    off = apply_overrides({"algorithm": {"m2po": None}}, {"algorithm": {"m2po": {"threshold": 1}}})
    assert off == {"algorithm": {"m2po": {"threshold": 1}}}


# --- corrections and losses of issue 14 ----------------------------------------------------------


def test_preset_args_are_checked_by_the_preset_constructor():
    ok = recipe_from_dict({"algorithm": {"correction": {
        "kind": "preset", "name": "decoupled_geo_rs_token_tis",
        "args": {"is_threshold": 3, "rs_threshold": "0.99_1.01"}}}})
    assert ok.algorithm.correction.args == {"is_threshold": 3, "rs_threshold": "0.99_1.01"}
    assert _error({"algorithm": {"correction": {
        "kind": "preset", "name": "decoupled_token_is", "args": {"is_threshold": 2.0}}}}) == (
        "recipe: algorithm.correction: preset decoupled_token_is has no argument is_threshold "
        "(its arguments: threshold)")
    msg = _error({"algorithm": {"correction": {
        "kind": "preset", "name": "decoupled_geo_rs", "args": {"rs_threshold": "1.01_0.99"}}}})
    assert msg.startswith("recipe: algorithm.correction: preset decoupled_geo_rs: ")
    assert "exceeds upper bound" in msg and msg.endswith("(its arguments: rs_threshold)")
    assert "got true" in _error({"algorithm": {"correction": {
        "kind": "preset", "name": "decoupled_token_is", "args": {"threshold": True}}}})
    assert "it takes no arguments" in _error({"algorithm": {"correction": {
        "kind": "preset", "name": "disabled", "args": {"threshold": 2.0}}}})


def test_decoupled_mis_is_a_correction_kind_with_an_icepop_default():
    r = recipe_from_dict({"algorithm": {"old_logprob": "snapshot",
                                        "correction": {"kind": "decoupled_mis"}}})
    assert r.algorithm.correction.engine.method == "icepop"
    assert r.algorithm.correction.engine.lower is None  # the method's band, [0.5, 5]
    assert "'decoupled_mis'" in _error({"algorithm": {"correction": {"kind": "mis"}}})


def test_loss_scale_factor_is_positive_or_none():
    assert Recipe().algorithm.loss.loss_scale_factor is None
    assert recipe_from_dict({"algorithm": {"loss": {"loss_scale_factor": 512}}}) \
        .algorithm.loss.loss_scale_factor == 512.0
    assert "algorithm.loss.loss_scale_factor" in _error(
        {"algorithm": {"loss": {"loss_scale_factor": 0}}})


def test_dro_needs_its_beta_and_the_learner_passes_it_on():
    from training.runtime.learner import policy_loss_config

    msg = _error({"algorithm": {"loss": {"name": "dro"}}})
    assert msg.startswith("recipe: algorithm.loss: ") and "dro_beta" in msg
    assert "\n" not in msg
    assert "algorithm.loss.dro_beta" in _error(
        {"algorithm": {"loss": {"name": "dro", "dro_beta": 0}}})
    r = recipe_from_dict({"algorithm": {"loss": {"name": "dro", "dro_beta": 0.2},
                                        "advantage": {"estimator": "grpo"}}})
    assert policy_loss_config(r).dro_beta == 0.2
    # the field at its default leaves every recorded hash as it was
    assert recipe_from_dict({"algorithm": {"loss": {"dro_beta": None}}}).hash() == Recipe().hash()
    assert r.hash() != recipe_from_dict({"algorithm": {"loss": {
        "name": "dro", "dro_beta": 0.3}, "advantage": {"estimator": "grpo"}}}).hash()


def test_issue_14_fields_at_their_defaults_keep_the_hash():
    """Hashes recorded before preset args and loss_scale_factor existed (asyncrl a50f1d2)."""
    preset = {"algorithm": {"correction": {"kind": "preset", "name": "decoupled_geo_rs"}}}
    assert recipe_from_dict(preset).hash() == "f78bf853f8b84edb"
    assert recipe_from_dict({"algorithm": {"correction": {
        "kind": "preset", "name": "decoupled_geo_rs", "args": {}}}}).hash() == "f78bf853f8b84edb"
    assert recipe_from_dict({"algorithm": {"correction": {
        "kind": "preset", "name": "decoupled_geo_rs", "args": {"rs_threshold": "0.99_1.01"}}}}
    ).hash() != "f78bf853f8b84edb"
    drgrpo = {"algorithm": {"loss": {"agg": "seq-mean-token-sum-norm"}}}
    assert recipe_from_dict(drgrpo).hash() == "367f8f1de28541ac"
    assert recipe_from_dict({"algorithm": {"loss": {"agg": "seq-mean-token-sum-norm",
                                                    "loss_scale_factor": 32}}}).hash() \
        != "367f8f1de28541ac"
    # the CompIS engine default changed (IcePop → none): the same run is written explicitly
    explicit = {"algorithm": {"old_logprob": "snapshot", "correction": {
        "kind": "compis", "engine": {"method": "icepop"}}}}
    assert recipe_from_dict(explicit).hash() == "66531c0ec6dcc354"


def test_combinations_without_meaning_are_refused():
    for old, corr, fix in (
            ("bypass", {"kind": "decoupled"}, "use old_logprob: snapshot, or a bypass preset"),
            ("bypass", {"kind": "preset", "name": "decoupled_token_is"}, "bypass_* preset"),
            ("bypass", {"kind": "decoupled_mis"}, "use old_logprob: snapshot"),
            ("loglinear", {"kind": "decoupled_mis"}, "use old_logprob: snapshot or ewma"),
            ("linear_prox", {"kind": "decoupled_mis"}, "use old_logprob: snapshot or ewma")):
        msg = _error({"algorithm": {"old_logprob": old, "correction": corr}})
        assert msg.startswith("recipe: algorithm: ") and fix in msg, msg


@pytest.mark.parametrize(("old", "correction", "expected"), [
    # effective strategy, old_is_exact, old_is_current, has_distinct_old
    ("recompute", {"kind": "none"}, ("recompute", False, True, True)),
    ("snapshot", {"kind": "compis"}, ("snapshot", True, False, True)),
    ("dedicated", {"kind": "compis"}, ("dedicated", True, False, True)),
    ("interrupt", {"kind": "compis"}, ("interrupt", True, False, True)),
    ("ewma", {"kind": "none"}, ("ewma", False, False, True)),
    ("loglinear", {"kind": "decoupled"}, ("loglinear", False, False, False)),
    ("linear_prox", {"kind": "decoupled"}, ("linear_prox", False, False, False)),
    ("bypass", {"kind": "none"}, ("bypass", False, False, False)),
    # a bypass preset forces bypass whatever old_logprob says
    ("snapshot", {"kind": "preset", "name": "bypass_ppo_clip"}, ("bypass", False, False, False)),
])
def test_the_recipe_says_what_pi_old_is(old, correction, expected):
    a = recipe_from_dict({"algorithm": {"old_logprob": old, "correction": correction}}).algorithm
    assert (a.effective_old_logprob, a.old_is_exact, a.old_is_current,
            a.has_distinct_old) == expected


def test_dedicated_old_logit_model_settings():
    assert recipe_from_dict({"algorithm": {"dedicated_versions": 2}}).hash() \
        == recipe_from_dict({}).hash()  # added later, at its default: the old hash
    assert recipe_from_dict({"algorithm": {"dedicated_versions": 3}}).hash() \
        != recipe_from_dict({}).hash()
    msg = _error({"algorithm": {"old_logprob": "dedicated", "dedicated_versions": 0}})
    assert "dedicated_versions" in msg and "\n" not in msg
    msg = _error({"algorithm": {"old_logprob": "dedicated"}, "engines": {"train": "megatron"}})
    assert "old_logprob: dedicated" in msg and "use old_logprob: snapshot" in msg, msg


@pytest.mark.parametrize(("spec", "expected"), [
    # quota threshold, sync interval, partial rollout, submission order, least staleness,
    # staleness bound, EWMA window
    ({"mode": "sync"}, (0.0, 1, False, True, 0, 0, 0.0)),
    ({"mode": "one_step", "max_off_policy_steps": 3}, (1.0, 1, False, True, 1, 1, 1.0)),
    ({"mode": "fully_async"}, (0.5, 1, True, False, 0, None, 1.5)),
    ({"mode": "fully_async", "staleness_threshold": 0.25, "trigger_parameter_sync_step": 4,
      "partial_rollout": False, "max_off_policy_steps": 5}, (0.25, 4, False, False, 3, 5, 5.0)),
])
def test_each_async_mode_carries_its_meaning(spec, expected):
    a = recipe_from_dict({"async": spec}).async_
    assert (a.quota_threshold, a.sync_interval, a.partial_rollout, a.submission_order,
            a.least_staleness, a.staleness_bound, a.ewma_window) == expected


def test_the_drain_order_follows_the_mode():
    data = {"data": {"drain": "fifo"}}
    assert recipe_from_dict({**data, "async": {"mode": "one_step"}}).drain == "submission"
    assert recipe_from_dict({**data, "async": {"mode": "fully_async"}}).drain == "fifo"


def test_a_checkpoint_with_an_origin_is_known_by_it_not_by_its_path():
    def recipe(path, origin=None, **extra):
        model = {"kind": "checkpoint", "path": path, **({"origin": origin} if origin else {}),
                 **extra}
        return recipe_from_dict({"model": model})

    origin = "recipe:0123456789abcdef"
    assert recipe("/a/hf", origin).hash() == recipe("/b/hf", origin).hash()
    assert recipe("/a/hf", origin).hash() != recipe("/a/hf", "recipe:fedcba9876543210").hash()
    assert recipe("/a/hf").hash() != recipe("/b/hf").hash()  # no origin: the path counts
    # a checkpoint recipe from before origin/moe_experts hashes as it did
    assert recipe("/a/hf").hash() == recipe("/a/hf", moe_experts=None).hash()
    with pytest.raises(RecipeError, match="origin"):
        recipe("/a/hf", "run 7")


def test_moe_checks_apply_to_a_checkpoint_whose_experts_are_known():
    def recipe(moe_experts):
        return {"model": {"kind": "checkpoint", "path": "/a/hf", "moe_experts": moe_experts},
                "algorithm": {"routing_replay": "r3"}}

    assert recipe_from_dict(recipe(4)).is_moe
    with pytest.raises(RecipeError, match="needs an MoE model"):
        recipe_from_dict(recipe(0))
    r = recipe_from_dict(recipe(None))  # unknown here: the run reads config.json
    assert not r.is_moe and r.moe_experts is None


def test_error_unions_come_from_the_schema():
    """Error messages name a union's tag from the schema itself (no second, hand-kept table)."""
    from training.recipe import error_unions

    assert error_unions() == {
        "model": ("kind", ("warmstart", "checkpoint")),
        "async": ("mode", ("sync", "one_step", "fully_async")),
        "correction": ("kind", ("none", "compis", "preset", "decoupled", "decoupled_mis")),
    }
    msg = _error({"name": "x", "async": {"mode": "fully_async", "bogus": 1}})
    assert "async.bogus" in msg and "fully_async.bogus" not in msg


# --- issue 17: KL loss term, reactive LR guards, routing_replay auto ------------------------------


def test_kl_in_loss_options_are_checked_with_the_fix() -> None:
    r = recipe_from_dict({"algorithm": {"kl": {"mode": "in_loss", "estimator": "k3",
                                               "is_correction": "deepseek_k3"}}})
    assert r.algorithm.kl.is_correction == "deepseek_k3"
    with pytest.raises(RecipeError, match=re.escape("set algorithm.kl.estimator: k3 (not k2)")):
        recipe_from_dict({"algorithm": {"kl": {"mode": "in_loss", "estimator": "k2",
                                               "is_correction": "deepseek_k3"}}})
    with pytest.raises(RecipeError, match=re.escape(
            "set algorithm.kl.mode: in_loss or is_correction: none")):
        recipe_from_dict({"algorithm": {"kl": {"mode": "in_reward", "is_correction": "clipped"}}})
    with pytest.raises(RecipeError, match="applies to mode in_reward"):
        recipe_from_dict({"algorithm": {"kl": {"mode": "in_loss", "target": 0.1}}})
    with pytest.raises(RecipeError, match=re.escape("algorithm.kl.is_correction")):
        recipe_from_dict({"algorithm": {"kl": {"mode": "in_loss", "is_correction": "yes"}}})


def test_guards_are_off_by_default_and_keep_old_hashes() -> None:
    plain = Recipe()
    assert plain.optim.vcpo is None and plain.optim.length_surge_guard is None
    # at their defaults the fields added later leave the hash of a recipe from before them
    spelt = recipe_from_dict({"optim": {"vcpo": None, "length_surge_guard": None},
                              "algorithm": {"kl": {"is_correction": "none"}}})
    assert spelt.hash() == plain.hash()
    on = recipe_from_dict({"optim": {"length_surge_guard": {}, "vcpo": {"min_scale": 0.2}}})
    g = on.optim.length_surge_guard
    assert (g.ratio, g.window_steps, g.factor, g.max_halvings) == (1.2, 100, 0.5, None)
    assert on.optim.vcpo.min_scale == 0.2 and on.hash() != plain.hash()
    with pytest.raises(RecipeError, match=re.escape("optim.length_surge_guard.ratio")):
        recipe_from_dict({"optim": {"length_surge_guard": {"ratio": 1.0}}})
    with pytest.raises(RecipeError, match=re.escape("optim.vcpo.min_scale")):
        recipe_from_dict({"optim": {"vcpo": {"min_scale": 0.0}}})


@pytest.mark.parametrize(("mode", "require_batches", "epochs", "n", "replay"), [
    ("sync", 1, 1, 1, "none"),   # on-policy: replay only adds bias (seed 004)
    ("sync", 2, 1, 2, "r2"),
    ("sync", 1, 3, 3, "r2"),
    ("sync", 2, 2, 4, "r3"),
    ("sync", 8, 1, 8, "r3"),
    ("one_step", 1, 1, 2, "r2"),  # one step of staleness doubles the updates a sample spans
    ("one_step", 2, 1, 4, "r3"),
])
def test_routing_replay_auto_resolves_by_off_policiness(mode, require_batches, epochs, n,
                                                       replay) -> None:
    moe = {"kind": "warmstart", "moe_experts": 4}
    r = recipe_from_dict({"model": moe, "algorithm": {"routing_replay": "auto"},
                          "async": {"mode": mode, "require_batches": require_batches},
                          "optim": {"epochs": epochs}})
    assert r.updates_per_batch == require_batches * epochs
    assert r.off_policiness == n and r.routing_replay == replay
    assert r.algorithm.routing_replay == "auto"


def test_routing_replay_auto_is_none_on_a_dense_model_and_explicit_values_stay() -> None:
    dense = recipe_from_dict({"algorithm": {"routing_replay": "auto"},
                              "async": {"mode": "sync", "require_batches": 8}})
    assert dense.routing_replay == "none"
    moe = {"kind": "warmstart", "moe_experts": 4}
    assert recipe_from_dict({"model": moe, "algorithm": {"routing_replay": "r2"},
                             "async": {"mode": "sync", "require_batches": 8}}
                            ).routing_replay == "r2"
    with pytest.raises(RecipeError, match="needs an MoE model"):
        recipe_from_dict({"algorithm": {"routing_replay": "r3"}})


def test_with_overrides_is_load_recipe_with_overrides_and_names_its_source():
    from training.recipe import RecipeError, load_recipe
    from training.recipe_identity import recipe_hash, recipe_identity

    path = RECIPES / "stress-one_step.yaml"
    over = {"optim.lr": 2e-5, "rollout": {"n": 16}}
    r = load_recipe(path).with_overrides(over)
    assert r == load_recipe(path, over) and recipe_hash(r) == recipe_hash(load_recipe(path, over))
    assert (r.optim.lr, r.rollout.n) == (2e-5, 16)
    # steps do not count in the identity a resume must match; everything else does
    assert recipe_identity(r) == recipe_identity(r.with_overrides({"steps": 500}))
    assert recipe_identity(r) != recipe_identity(r.with_overrides({"seed": 7}))
    with pytest.raises(RecipeError) as info:
        r.with_overrides({"optim.lr": -1.0}, "candidate x")
    assert str(info.value).startswith("candidate x") and "\n" not in str(info.value)
