"""The old-log-prob strategy objects: the factory's choice for every strategy (a bypass preset
forcing bypass), the one-line errors, and estimates worked out by hand on tiny tensors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from training.algorithms.rollout_correction import PRESETS
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.model import ModelConfig
from training.engines.train import OptimConfig
from training.recipe import OLD_LOGPROB_STRATEGIES, RecipeError, recipe_from_dict
from training.runtime.learner import Learner, build_step
from training.runtime.old_policy import (
    STRATEGIES,
    BypassOld,
    DedicatedOld,
    EwmaOld,
    InterruptOld,
    LinearProxOld,
    LoglinearOld,
    OldPolicyError,
    RecomputeOld,
    SnapshotOld,
    old_policy,
)

CLASSES = {"recompute": RecomputeOld, "snapshot": SnapshotOld, "dedicated": DedicatedOld,
           "interrupt": InterruptOld, "ewma": EwmaOld, "loglinear": LoglinearOld,
           "linear_prox": LinearProxOld, "bypass": BypassOld}


def _engine():
    cfg = ModelConfig(vocab_size=100, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                      intermediate_size=8)
    return EmbeddedTrainEngine.from_config(cfg, seed=0, optim=OptimConfig(lr=1e-2))


def _recipe(algorithm):
    return recipe_from_dict({"algorithm": algorithm})


# ------------------------------------------------------------------------------------------------
# the factory
# ------------------------------------------------------------------------------------------------


def test_every_strategy_of_the_recipe_has_exactly_one_class():
    assert set(STRATEGIES) == set(OLD_LOGPROB_STRATEGIES) == set(CLASSES)
    assert all(STRATEGIES[name] is cls for name, cls in CLASSES.items())


@pytest.mark.parametrize("strategy", OLD_LOGPROB_STRATEGIES)
def test_the_factory_builds_the_recipes_strategy(strategy):
    recipe = _recipe({"old_logprob": strategy})
    policy = old_policy(recipe, _engine())
    assert type(policy) is CLASSES[strategy]
    assert policy.name == recipe.algorithm.effective_old_logprob == strategy


@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if p.startswith("bypass_")))
@pytest.mark.parametrize("strategy", ["snapshot", "recompute", "ewma"])
def test_a_bypass_preset_forces_bypass(strategy, preset):
    recipe = _recipe({"old_logprob": strategy, "correction": {"kind": "preset", "name": preset}})
    assert recipe.algorithm.effective_old_logprob == "bypass"
    assert type(old_policy(recipe, _engine())) is BypassOld


def test_a_decoupled_preset_keeps_the_strategy():
    recipe = _recipe({"old_logprob": "snapshot",
                      "correction": {"kind": "preset", "name": "decoupled_token_is"}})
    assert type(old_policy(recipe, _engine())) is SnapshotOld


def test_the_recipes_bypass_rule_is_the_presets_bypass_mode():
    """The learner once derived bypass from the built preset's ``bypass_mode``; the recipe decides
    it from the preset's name. The two agree for every preset."""
    for name, make in PRESETS.items():
        assert make().bypass_mode == name.startswith("bypass_"), name


# ------------------------------------------------------------------------------------------------
# errors (the same one line as before)
# ------------------------------------------------------------------------------------------------


def test_an_unknown_strategy_is_one_line():
    recipe = _recipe({})
    alg = recipe.algorithm.model_copy(update={"old_logprob": "nope"})
    broken = recipe.model_copy(update={"algorithm": alg})
    with pytest.raises(OldPolicyError) as info:
        old_policy(broken, _engine())
    assert str(info.value) == "unknown old_logprob strategy 'nope'"
    assert isinstance(info.value, ValueError)


def test_a_refused_combination_is_refused_by_the_recipe():
    with pytest.raises(RecipeError) as info:
        _recipe({"old_logprob": "bypass", "correction": {"kind": "compis"}})
    msg = str(info.value)
    assert "\n" not in msg and "CompIS needs π_old distinct from the rollout log-probs" in msg


def test_bypass_mode_loss_without_a_bypass_preset():
    with pytest.raises(ValueError) as info:
        build_step(_recipe({"loss": {"name": "bypass_mode"}}))
    assert str(info.value) == (
        "algorithm.loss.name=bypass_mode takes its IS/RS settings from a bypass "
        "rollout-correction preset: set algorithm.correction to {kind: preset, name: "
        "bypass_ppo_clip} (or another bypass_* preset)")


def test_ewma_needs_an_engine_with_its_parameters():
    with pytest.raises(OldPolicyError) as info:
        old_policy(_recipe({"old_logprob": "ewma"}), SimpleNamespace(weight_version=0))
    assert str(info.value) == (
        "old_logprob: ewma needs an engine that exposes its parameters and "
        "compute_log_probs_with_weights, or keeps the reference itself (ewma_update); use "
        "snapshot or recompute with this backend")


# ------------------------------------------------------------------------------------------------
# estimates by hand
# ------------------------------------------------------------------------------------------------


def _packed(versions, mu, samples=()):
    versions = torch.tensor(versions, dtype=torch.long)
    return SimpleNamespace(batch=SimpleNamespace(response_mask=torch.ones_like(versions,
                                                                               dtype=torch.bool)),
                           samples=list(samples), token_versions=versions,
                           rollout_log_prob=torch.tensor(mu))


def test_recompute_is_the_current_policy_exact_on_the_start_version():
    policy = old_policy(_recipe({"old_logprob": "recompute"}), SimpleNamespace(weight_version=2))
    current = torch.tensor([[-0.5, -0.7, -0.9]])
    est = policy.reference(_packed([[1, 2, 2]], [[-1.0, -1.0, -1.0]]), current)
    assert est.proximal is current and est.old is current
    assert est.exact.tolist() == [[False, True, True]] and est.metrics == {}


def test_loglinear_by_hand_in_versions_and_in_steps():
    policy = old_policy(_recipe({"old_logprob": "loglinear"}), SimpleNamespace(weight_version=2))
    mu = [[-1.0, -1.0, -1.0]]
    current = torch.tensor([[-0.5, -0.5, -0.5]])
    # α = (v_θ − 1 − v_b)/(v_θ − v_b): v_b = 0 → 1/2, v_b = 1 → 0, v_b = 2 → 0
    est = policy.reference(_packed([[0, 1, 2]], mu), current)
    assert est.extra["loglinear_alpha"].tolist() == [[0.5, 0.0, 0.0]]
    assert torch.allclose(est.proximal, torch.tensor([[-0.75, -1.0, -1.0]]))
    assert torch.equal(est.old, torch.tensor(mu)) and est.exact is None
    assert est.metrics == {"old/loglinear_alpha_mean": pytest.approx(0.5 / 3)}
    assert set(est.metrics) <= set(policy.metric_names)
    # versions 0, 2, 4 are trainer steps 0, 1, 2: the same α once mapped (the engine's version
    # is not read then)
    est = policy.reference(_packed([[0, 2, 4]], mu), current, step=2,
                           version_to_step=lambda v: v // 2)
    assert est.extra["loglinear_alpha"].tolist() == [[0.5, 0.0, 0.0]]


def test_linear_prox_by_hand():
    policy = old_policy(_recipe({"old_logprob": "linear_prox"}),
                        SimpleNamespace(weight_version=2))
    est = policy.reference(_packed([[0, 2]], [[math.log(0.2), math.log(0.2)]]),
                           torch.tensor([[math.log(0.6), math.log(0.6)]]))
    # ½·0.2 + ½·0.6 = 0.4 on the α = ½ token; μ on the current-version one
    assert torch.allclose(est.proximal, torch.tensor([[math.log(0.4), math.log(0.2)]]))


def test_interrupt_reads_the_samples_and_falls_back_without_them():
    policy = old_policy(_recipe({"old_logprob": "interrupt"}), SimpleNamespace(weight_version=1))
    samples = [SimpleNamespace(response_len=2, old_log_probs=[-0.1, -0.2]),
               SimpleNamespace(response_len=2, old_log_probs=[])]
    current = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    est = policy.reference(_packed([[0, 0], [0, 0]], [[-3.0, -3.0], [-3.0, -3.0]], samples),
                           current)
    assert torch.allclose(est.old, torch.tensor([[-0.1, -0.2], [-2.0, -2.0]]))
    assert est.proximal is current
    assert est.exact.tolist() == [[True, True], [False, False]]
    assert est.metrics == {"old/interrupt_fallback_frac": 0.5}


def test_decoupled_mis_centres_the_clip_at_the_old_policy():
    policy = old_policy(_recipe({"old_logprob": "interrupt",
                                 "correction": {"kind": "decoupled_mis"}}),
                        SimpleNamespace(weight_version=1))
    samples = [SimpleNamespace(response_len=1, old_log_probs=[-0.3])]
    est = policy.reference(_packed([[0]], [[-1.0]], samples), torch.tensor([[-0.5]]))
    assert est.proximal is est.old and est.old.tolist() == [[pytest.approx(-0.3)]]


class _TinyEngine:
    """Two parameters and a forward that returns whatever it is told, recording the weights it
    was given."""

    def __init__(self, w):
        self.model = torch.nn.Linear(2, 1, bias=False)
        self.set(w)
        self.given = None

    def set(self, w):
        with torch.no_grad():
            self.model.weight.copy_(torch.tensor([w]))

    def compute_log_probs_with_weights(self, batch, weights, **kw):
        self.given = {k: v.clone() for k, v in weights.items()}
        return SimpleNamespace(log_probs=torch.tensor([[-0.4]]))


def test_ewma_update_rule_by_hand():
    recipe = _recipe({"old_logprob": "ewma",
                      "ewma": {"staleness_window": 2.0, "reset_mask_frac": 0.1}})
    eng = _TinyEngine([1.0, 2.0])
    policy = old_policy(recipe, eng)
    assert policy.state.reference["weight"].tolist() == [[1.0, 2.0]]  # initialised at θ_0
    assert policy.held_bytes() == 2 * 4
    eng.set([3.0, 6.0])
    # β = W/(W+2) = ½: ref ← ½·(1, 2) + ½·(3, 6) = (2, 4)
    m = policy.after_step(True, {"old/ewma_mask_frac": 0.05})
    assert policy.state.reference["weight"].tolist() == [[2.0, 4.0]]
    assert m == {"old/ewma_beta": 0.5, "old/ewma_resets": 0.0,
                 "old/ewma_updates_since_reset": 1.0}
    est = policy.reference(_packed([[0]], [[-1.0]]), torch.tensor([[-0.5]]))
    assert eng.given["weight"].tolist() == [[2.0, 4.0]]  # π_old under the reference
    assert est.proximal is est.old and est.old.tolist() == [[pytest.approx(-0.4)]]
    eng.set([0.0, 0.0])
    m = policy.after_step(False, {"old/ewma_mask_frac": 0.5})  # nothing trained: unchanged
    assert policy.state.reference["weight"].tolist() == [[2.0, 4.0]]
    assert m["old/ewma_updates_since_reset"] == 1.0
    m = policy.after_step(True, {"old/ewma_mask_frac": 0.5})  # 0.5 > 0.1: reset to θ
    assert policy.state.reference["weight"].tolist() == [[0.0, 0.0]]
    assert m["old/ewma_resets"] == 1.0 and m["old/ewma_updates_since_reset"] == 0.0
    # no correction mask: the share of π_old/μ outside [0.5, 5] (0.25 and 10 of 4 tokens)
    mask = torch.ones(1, 4, dtype=torch.bool)
    old = torch.zeros(1, 4)
    mu = -torch.log(torch.tensor([[1.0, 0.25, 10.0, 1.0]]))
    assert policy.correction_metrics(mask, None, False, old, mu, mask) == {
        "old/ewma_mask_frac": 0.5}
    assert set(m) | {"old/ewma_mask_frac"} <= set(policy.metric_names)


# ------------------------------------------------------------------------------------------------
# checkpoint state
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ewma", "dedicated"])
def test_the_learner_state_keeps_its_keys(strategy):
    """The strategies keep no checkpoint state: the learner's state is what it was, and a state
    written before the strategy objects loads."""
    learner = Learner(_engine(), _recipe({"old_logprob": strategy}))
    assert learner.state_dict() == {}
    guarded = recipe_from_dict({"algorithm": {"old_logprob": strategy},
                                "optim": {"length_surge_guard": {"window_steps": 2}}})
    learner = Learner(_engine(), guarded)
    state = learner.state_dict()
    assert set(state) == {"length_surge_guard"}
    learner.load_state_dict(state)
