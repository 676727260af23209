"""Learner: the KL-to-reference loss term (algorithm.kl.mode: in_loss), the reactive LR guards
(optim.vcpo, optim.length_surge_guard) and routing_replay: auto, checked by hand on a tiny
embedded engine."""

import logging

import pytest
import torch

from training.algorithms.kl import kl_loss_term
from training.algorithms.policy_loss import agg_loss
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.model import ModelConfig
from training.engines.train import OptimConfig, TokenBatch
from training.recipe import Recipe
from training.runtime.learner import Learner
from training.runtime.types import Group, Sample

V = 100
LR = 1e-2


def _engine(experts=0):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                      intermediate_size=40, num_experts=experts, num_experts_per_tok=2)
    return EmbeddedTrainEngine.from_config(cfg, seed=0, optim=OptimConfig(lr=LR))


def _recipe(algorithm=None, moe=False, **sections):
    data = {"algorithm": algorithm or {}, "rollout": {"n": 3}, **sections}
    if moe:
        data["model"] = {"kind": "warmstart", "moe_experts": 4}
    return Recipe.model_validate(data)


def _groups(engine, *, n_groups=2, n=3, seed=0, first_id=0, length=None, mu_noise=0.0):
    """Groups whose rollout log-probs are the engine's own (+ ``mu_noise`` · N(0, 1)); every
    response has ``length`` tokens when given."""
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(4, V, (k,), generator=g).tolist()

    groups, v = [], engine.weight_version
    for gi in range(n_groups):
        prompt = [1, *ids(3)]
        samples = []
        for j in range(n):
            k = length if length is not None else 3 + (gi + j) % 4
            response = [*ids(k - 1), 2]
            samples.append(Sample(
                group_id=first_id + gi, sample_index=j, prompt_id=f"p{first_id + gi}",
                prompt_ids=prompt, response_ids=response, rollout_log_probs=[0.0] * k,
                token_versions=[v] * k, loss_mask=[1] * k, reward=float((gi + j) % 2),
                difficulty=0))
        groups.append(Group(group_id=first_id + gi, prompt_id=f"p{first_id + gi}", difficulty=0,
                            answer="", submit_step=0, samples=samples))
    samples = [s for grp in groups for s in grp.samples]
    batch = TokenBatch.from_sequences([s.prompt_ids for s in samples],
                                      [s.response_ids for s in samples])
    lp = engine.compute_log_probs(batch).log_probs
    lp = lp + mu_noise * torch.randn(lp.shape, generator=g)
    for i, s in enumerate(samples):
        s.rollout_log_probs = lp[i, : s.response_len].tolist()
    return groups


# ------------------------------------------------------------------------------------------------
# KL as a loss term
# ------------------------------------------------------------------------------------------------


def test_kl_in_loss_adds_the_is_corrected_term_to_the_loss(tmp_path):
    eng = _engine()
    eng.export_weights(tmp_path / "ref")
    recipe = _recipe({"old_logprob": "recompute",
                      "kl": {"mode": "in_loss", "coef": 0.1, "estimator": "k3",
                             "is_correction": "clipped"}})
    with pytest.raises(ValueError, match="reference"):
        Learner(eng, recipe)
    learner = Learner(eng, recipe, reference_dir=tmp_path / "ref", keep_tensors=True)
    first = learner.step(_groups(eng, seed=1), step=0)
    # π_θ = π_ref before the first update: k3 = 0 on every token
    assert first.metrics["policy/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    res = learner.step(_groups(eng, seed=2, first_id=2), step=1)
    d = res.debug
    # one optimizer step from the step's start weights: π_θ = π_prox, so ρ = 1 and the term is
    # k3(π_θ ‖ π_ref), token-mean over the trained tokens
    term, _ = kl_loss_term(d["current_log_prob"], d["proximal_log_prob"], d["ref_log_prob"],
                           d["keep_mask"], "k3", "clipped")
    expected = float(agg_loss(term, d["keep_mask"], "token-mean"))
    assert expected > 1e-6
    assert res.metrics["policy/kl_loss"] == pytest.approx(expected, rel=1e-4)
    assert res.metrics["policy/kl_coef"] == 0.1
    assert res.metrics["policy/kl_loss/is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert res.metrics["train/loss"] == pytest.approx(
        res.metrics["train/pg_loss"] + 0.1 * expected, rel=1e-4, abs=1e-7)
    # in_loss does not touch the reward: the scalar reward alone sits on the last token
    assert "kl/value" not in res.metrics
    assert float(d["token_level_rewards"].sum()) == pytest.approx(
        sum(s.reward for g in _groups(eng, seed=2, first_id=2) for s in g.samples))


# ------------------------------------------------------------------------------------------------
# reactive LR guards
# ------------------------------------------------------------------------------------------------


def test_vcpo_scales_the_lr_by_the_ess_of_the_behaviour_ratio():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute"},
                                   optim={"vcpo": {"min_scale": 0.05}}), keep_tensors=True)
    res = learner.step(_groups(eng, seed=3, mu_noise=0.5), step=0)
    d = res.debug
    mask = d["response_mask"]
    # no correction applies weights: w = π_current / μ on the loss tokens
    w = (d["current_log_prob"] - d["rollout_log_prob"]).exp()[mask].double()
    ess = float(w.sum() ** 2 / (w.numel() * (w * w).sum()))
    assert 0.3 < ess < 0.99
    assert res.metrics["guard/vcpo_ess"] == pytest.approx(ess, rel=1e-6)
    assert res.metrics["guard/vcpo_lr_scale"] == pytest.approx(ess, rel=1e-6)
    assert res.metrics["guard/lr_scale"] == pytest.approx(ess, rel=1e-6)
    assert res.metrics["train/lr"] == pytest.approx(LR * ess, rel=1e-6)


def test_vcpo_reads_the_weights_the_correction_applies():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute",
                                    "correction": {"kind": "decoupled",
                                                   "behaviour_weight_cap": 2.0}},
                                   optim={"vcpo": {}}), keep_tensors=True)
    res = learner.step(_groups(eng, seed=4, mu_noise=0.5), step=0)
    d = res.debug
    mask = d["response_mask"]
    w = torch.where(d["keep_mask"], d["is_weights"], torch.zeros_like(d["is_weights"]))
    w = w[mask].double()
    ess = float(w.sum() ** 2 / (w.numel() * (w * w).sum()))
    assert res.metrics["guard/vcpo_lr_scale"] == pytest.approx(max(ess, 0.05), rel=1e-6)
    assert res.metrics["is/combined/ess"] == pytest.approx(ess, rel=1e-5)
    assert res.metrics["train/lr"] == pytest.approx(LR * max(ess, 0.05), rel=1e-6)


def test_length_surge_halves_the_lr_logs_it_and_survives_a_restore(caplog):
    recipe = _recipe({"old_logprob": "recompute"},
                     optim={"length_surge_guard": {"window_steps": 1}})
    eng = _engine()
    learner = Learner(eng, recipe)
    r0 = learner.step(_groups(eng, seed=5, length=4), step=0)
    assert r0.metrics["train/lr"] == LR and r0.metrics["guard/lr_halvings"] == 0.0
    assert r0.events == ()
    with caplog.at_level(logging.WARNING, logger="asyncrl.runtime"):
        r1 = learner.step(_groups(eng, seed=6, length=6, first_id=2), step=1)  # 6 / 4 = 1.5
    assert r1.metrics["guard/lr_halvings"] == 1.0 and r1.metrics["guard/lr_halved"] == 1.0
    assert r1.metrics["guard/length_surge_ratio"] == pytest.approx(1.5)
    assert r1.metrics["train/lr"] == LR / 2 and r1.metrics["guard/lr_scale"] == 0.5
    assert len(r1.events) == 1 and r1.events[0].startswith("step 1: learning rate ×0.5")
    assert "1.50×" in r1.events[0] and r1.events[0] in caplog.text
    # the window restarted at step 1: the same length one step later halves nothing
    r2 = learner.step(_groups(eng, seed=7, length=6, first_id=4), step=2)
    assert r2.metrics["guard/lr_halvings"] == 1.0 and r2.metrics["train/lr"] == LR / 2
    # a resumed learner (its state from the checkpoint) keeps the halved rate
    state = learner.state_dict()
    assert state["length_surge_guard"]["halvings"] == 1
    eng2 = _engine()
    resumed = Learner(eng2, recipe)
    resumed.load_state_dict(state)
    r3 = resumed.step(_groups(eng2, seed=8, length=6, first_id=6), step=3)
    assert r3.metrics["guard/lr_halvings"] == 1.0 and r3.metrics["train/lr"] == LR / 2
    assert Learner(_engine(), _recipe()).state_dict() == {}


# ------------------------------------------------------------------------------------------------
# routing_replay: auto
# ------------------------------------------------------------------------------------------------


def test_routing_replay_auto_reaches_the_step_config_and_the_learner():
    recipe = _recipe({"routing_replay": "auto"}, moe=True,
                     **{"async": {"mode": "sync", "require_batches": 2}})
    assert recipe.routing_replay == "r2"
    eng = _engine(experts=4)
    learner = Learner(eng, recipe)
    assert learner.plan.config.routing == "r2"
    res = learner.step(_groups(eng, n_groups=2), step=0)
    assert res.trained and res.weight_version == 2 and res.metrics["moe/replay_mode"] == 2.0
    on_policy = _recipe({"routing_replay": "auto"}, moe=True)
    assert on_policy.routing_replay == "none"
    assert Learner(_engine(experts=4), on_policy).plan.config.routing == "free"
