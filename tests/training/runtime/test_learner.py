"""Learner: one trainer step over groups — old-log-prob strategies, corrections, rejection,
metrics."""

import logging
import math

import numpy as np
import pytest
import torch

from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.model import ModelConfig
from training.engines.train import OptimConfig, TokenBatch
from training.recipe import Recipe
from training.runtime.learner import (
    Learner,
    engine_optim_config,
    repetition_rate,
)
from training.runtime.old_policy import BypassOld, ewma_staleness_window
from training.runtime.types import Group, Sample

V = 100


def _engine(experts=0, **kw):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                      intermediate_size=40, num_experts=experts, num_experts_per_tok=2)
    kw.setdefault("optim", OptimConfig(lr=1e-2))
    return EmbeddedTrainEngine.from_config(cfg, seed=0, **kw)


def _recipe(algorithm=None, moe=False, **sections):
    data = {"algorithm": algorithm or {}, "rollout": {"n": 3}, **sections}
    if moe:
        data["model"] = {"kind": "warmstart", "moe_experts": 4}
    return Recipe.model_validate(data)


def _batch_of(samples, routes=False):
    return TokenBatch.from_sequences(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        routes=[s.routes for s in samples] if routes else None)


def _groups(engine, n_groups=2, n=3, seed=0, first_id=0, rewards=None, routes=False):
    """Groups whose rollout log-probs are the engine's own (current weights, free routing)."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(4, V, (k,), generator=g).tolist()

    groups = []
    v = engine.weight_version
    for gi in range(n_groups):
        samples = []
        prompt = [1, *ids(2, 6)]
        for j in range(n):
            response = [*ids(3, 8), 2]
            reward = float((gi + j) % 2) if rewards is None else rewards[gi][j]
            samples.append(Sample(
                group_id=first_id + gi, sample_index=j, prompt_id=f"p{first_id + gi}",
                prompt_ids=prompt, response_ids=response, rollout_log_probs=[0.0] * len(response),
                token_versions=[v] * len(response), loss_mask=[1] * len(response),
                reward=reward, difficulty=gi % 2))
        groups.append(Group(group_id=first_id + gi, prompt_id=f"p{first_id + gi}",
                            difficulty=gi % 2, answer="", submit_step=0, samples=samples))
    samples = [s for grp in groups for s in grp.samples]
    res = engine.compute_log_probs(_batch_of(samples))
    for i, s in enumerate(samples):
        s.rollout_log_probs = res.log_probs[i, : s.response_len].tolist()
        if routes:
            s.routes = res.routes[i].numpy()
    return groups


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _finite(metrics):
    bad = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isfinite(v))}
    assert not bad, bad


# ------------------------------------------------------------------------------------------------
# old log-prob strategies
# ------------------------------------------------------------------------------------------------


def test_recompute_old_equals_proximal_and_trains():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute"}), keep_tensors=True)
    res = learner.step(_groups(eng), step=0)
    assert res.trained and res.rejected_reason is None
    assert res.weight_version == 1 == eng.weight_version
    d = res.debug
    assert torch.equal(d["old_log_prob"], d["proximal_log_prob"])
    assert torch.equal(d["proximal_log_prob"], d["current_log_prob"])
    # μ is the engine's own log-probs: no engine mismatch
    assert res.metrics["mismatch/train_rollout/logprob_abs_diff/max"] < 1e-5
    assert res.metrics["mismatch/engine/logprob_abs_diff/max"] < 1e-5
    assert res.metrics["async/rejected_batch"] == 0.0
    assert res.metrics["step/weight_version"] == 1.0
    assert res.metrics["async/batch_samples"] == 6.0
    _finite(res.metrics)
    for key in ("policy/grad_norm", "policy/grad_norm_max", "policy/lr", "policy/approx_kl",
                "policy/entropy/mean", "policy/entropy/p99", "train/loss",
                "rollout/response_length/p90", "mismatch/train_rollout/kl_k3",
                "mismatch/engine/kl_k3"):
        assert key in res.metrics, key


def test_snapshot_old_is_exact_per_token_version():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "snapshot"}), keep_tensors=True)
    assert learner.step(_groups(eng, seed=1), step=0).trained  # version 0 → 1
    groups = _groups(eng, seed=2, first_id=10)  # μ at version 1 (values irrelevant here)
    samples = [s for g in groups for s in g.samples]
    for s in samples:  # first half of each response generated by version 0, the rest by 1
        half = s.response_len // 2
        s.token_versions = [0] * half + [1] * (s.response_len - half)
    res = learner.step(groups, step=1)
    assert res.trained
    batch = _batch_of(samples)
    lp0 = eng.compute_log_probs(batch, version=0).log_probs
    # the step moved the weights to 2: version 1 is now a snapshot too
    lp1 = eng.compute_log_probs(batch, version=1).log_probs
    old = res.debug["old_log_prob"]
    for i, s in enumerate(samples):
        half = s.response_len // 2
        assert torch.allclose(old[i, :half], lp0[i, :half], atol=1e-5)
        assert torch.allclose(old[i, half : s.response_len], lp1[i, half : s.response_len],
                              atol=1e-5)
    assert not torch.allclose(lp0, lp1, atol=1e-4)  # the check can tell versions apart
    assert res.metrics["old/snapshot_fallback_frac"] == 0.0
    assert torch.equal(res.debug["proximal_log_prob"], res.debug["current_log_prob"])


def test_snapshot_falls_back_to_current_when_version_not_retained(caplog):
    eng = _engine(snapshot_budget_bytes=0)
    learner = Learner(eng, _recipe({"old_logprob": "snapshot"}), keep_tensors=True)
    learner.step(_groups(eng, seed=1), step=0)
    groups = _groups(eng, seed=2, first_id=10)
    samples = [s for g in groups for s in g.samples]
    samples[0].token_versions = [0] * samples[0].response_len
    with caplog.at_level(logging.WARNING, logger="asyncrl.runtime"):
        res = learner.step(groups, step=1)
    total = sum(s.response_len for s in samples)
    assert res.metrics["old/snapshot_fallback_frac"] == pytest.approx(
        samples[0].response_len / total)
    assert torch.equal(res.debug["old_log_prob"], res.debug["current_log_prob"])
    assert "not retained" in caplog.text


def test_bypass_uses_rollout_log_probs_everywhere():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "bypass"}), keep_tensors=True)
    groups = _groups(eng)
    for s in groups[0].samples:
        s.rollout_log_probs = [lp - 0.05 for lp in s.rollout_log_probs]
    res = learner.step(groups, step=0)
    d = res.debug
    assert torch.equal(d["old_log_prob"], d["rollout_log_prob"])
    assert torch.equal(d["proximal_log_prob"], d["rollout_log_prob"])
    # train_rollout compares the current trainer log-probs; π_old = μ: the engine family reads 0
    assert res.metrics["mismatch/train_rollout/logprob_abs_diff/max"] == pytest.approx(
        0.05, abs=1e-4)
    assert res.metrics["mismatch/engine/logprob_abs_diff/max"] == 0.0
    assert res.trained


def test_loglinear_alpha_by_hand():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "loglinear"}), keep_tensors=True)
    learner.step(_groups(eng, seed=1), step=0)
    learner.step(_groups(eng, seed=2, first_id=2), step=1)
    assert eng.weight_version == 2
    groups = _groups(eng, n_groups=1, seed=3, first_id=4)
    samples = groups[0].samples
    for s in samples:  # versions 0, then 1, then 2 (current)
        o = s.response_len
        s.token_versions = [0] * (o - 2) + [1, 2]
        s.rollout_log_probs = [lp - 0.3 for lp in s.rollout_log_probs]
    res = learner.step(groups, step=2)
    d = res.debug
    mu, cur = d["rollout_log_prob"], d["current_log_prob"]
    alpha = torch.zeros_like(mu)
    for i, s in enumerate(samples):
        alpha[i, : s.response_len - 2] = 0.5  # (v_prox − v_b)/(v_θ − v_b) = (1 − 0)/(2 − 0)
    assert torch.allclose(d["loglinear_alpha"], alpha)
    expected = torch.where(d["response_mask"], mu + alpha * (cur - mu), torch.zeros_like(mu))
    assert torch.allclose(d["proximal_log_prob"], expected, atol=1e-6)
    assert torch.equal(d["old_log_prob"], mu)
    n_tok = sum(s.response_len for s in samples)
    assert res.metrics["old/loglinear_alpha_mean"] == pytest.approx(
        0.5 * sum(s.response_len - 2 for s in samples) / n_tok)


def test_linear_prox_interpolates_in_probability_space_with_the_loglinear_alpha():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "linear_prox"}), keep_tensors=True)
    learner.step(_groups(eng, seed=1), step=0)
    learner.step(_groups(eng, seed=2, first_id=2), step=1)
    groups = _groups(eng, n_groups=1, seed=3, first_id=4)
    samples = groups[0].samples
    for s in samples:  # versions 0, then 1, then 2 (current): α = 0.5, 0, 0
        o = s.response_len
        s.token_versions = [0] * (o - 2) + [1, 2]
        s.rollout_log_probs = [lp - 0.3 for lp in s.rollout_log_probs]
    d = learner.step(groups, step=2).debug
    mu, cur, mask = d["rollout_log_prob"], d["current_log_prob"], d["response_mask"]
    alpha = torch.zeros_like(mu)
    for i, s in enumerate(samples):
        alpha[i, : s.response_len - 2] = 0.5
    assert torch.allclose(d["loglinear_alpha"], alpha)
    # log(½μ + ½π) where α = ½, μ elsewhere; μ = π − 0.3 so the α = ½ tokens sit at
    # π + log((e^−0.3 + 1)/2)
    expected = torch.where(alpha > 0, cur + math.log((math.exp(-0.3) + 1) / 2), mu)
    expected = torch.where(mask, expected, torch.zeros_like(mu))
    assert torch.allclose(d["proximal_log_prob"], expected, atol=1e-5)
    assert torch.equal(d["old_log_prob"], mu)


def _synced(learner, eng):
    """What the run does after a sync: the dedicated model loads the trainer's version."""
    learner.weights_synced(eng.weight_version, list(range(eng.weight_version + 1)))


def test_dedicated_old_is_exact_per_token_version_and_reports_its_cost():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "dedicated"}), keep_tensors=True)
    one = sum(p.numel() * 4 for p in eng.model.parameters())  # fp32, like the trainer
    assert learner.step(_groups(eng, seed=1), step=0).trained  # version 0 → 1
    _synced(learner, eng)  # the dedicated model holds 1 (live) and 0 (kept)
    groups = _groups(eng, seed=2, first_id=10)
    samples = [s for g in groups for s in g.samples]
    for s in samples:  # first half of each response generated by version 0, the rest by 1
        half = s.response_len // 2
        s.token_versions = [0] * half + [1] * (s.response_len - half)
    res = learner.step(groups, step=1)
    assert res.trained
    batch = _batch_of(samples)
    lp0 = eng.compute_log_probs(batch, version=0).log_probs
    lp1 = eng.compute_log_probs(batch, version=1).log_probs
    old = res.debug["old_log_prob"]
    for i, s in enumerate(samples):
        half = s.response_len // 2
        assert torch.allclose(old[i, :half], lp0[i, :half], atol=1e-5)
        assert torch.allclose(old[i, half : s.response_len], lp1[i, half : s.response_len],
                              atol=1e-5)
    assert not torch.allclose(lp0, lp1, atol=1e-4)
    m = res.metrics
    assert m["old/dedicated_fallback_frac"] == 0.0 and m["old/exact_frac"] == 1.0
    assert m["mismatch/engine/exact"] == 1.0 and m["old/dedicated_versions"] == 2.0
    # live weights (version 1), the kept version 0 and the shadow model that ran it
    assert m["old/dedicated_bytes"] == 3 * one
    assert m["old/dedicated_s"] > 0
    assert torch.equal(res.debug["proximal_log_prob"], res.debug["current_log_prob"])


def test_dedicated_counts_tokens_of_versions_it_no_longer_holds(caplog):
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "dedicated", "dedicated_versions": 1}),
                      keep_tensors=True)
    learner.step(_groups(eng, seed=1), step=0)
    _synced(learner, eng)  # holds version 1 only: 0 is gone
    groups = _groups(eng, seed=2, first_id=10)
    samples = [s for g in groups for s in g.samples]
    samples[0].token_versions = [0] * samples[0].response_len
    with caplog.at_level(logging.WARNING, logger="asyncrl.runtime"):
        res = learner.step(groups, step=1)
    total = sum(s.response_len for s in samples)
    frac = samples[0].response_len / total
    m = res.metrics
    assert m["old/dedicated_fallback_frac"] == pytest.approx(frac)
    assert m["old/exact_frac"] == pytest.approx(1 - frac)
    assert m["mismatch/engine/exact"] == 0.0 and m["old/dedicated_versions"] == 1.0
    d = res.debug
    o = samples[0].response_len
    assert torch.equal(d["old_log_prob"][0, :o], d["current_log_prob"][0, :o])
    assert d["dedicated_fallback_mask"][0, :o].all() and not d["dedicated_fallback_mask"][1:].any()
    assert "not held" in caplog.text and "dedicated_versions" in caplog.text


def test_held_bytes_count_every_parameter_copy_kept_for_old_policies():
    one = sum(p.numel() * 4 for p in _engine().model.parameters())
    eng = _engine(snapshot_budget_bytes=0)
    m = Learner(eng, _recipe({"old_logprob": "recompute"})).step(_groups(eng), step=0).metrics
    assert m["old/held_bytes"] == 0.0
    eng = _engine()  # the trainer snapshots version 0 before its update; no shadow model ran
    m = Learner(eng, _recipe({"old_logprob": "snapshot"})).step(_groups(eng), step=0).metrics
    assert m["old/held_bytes"] == one
    eng = _engine(snapshot_budget_bytes=0)  # the EWMA reference and the shadow model running it
    m = Learner(eng, _recipe({"old_logprob": "ewma"})).step(_groups(eng), step=0).metrics
    assert m["old/held_bytes"] == 2 * one
    eng = _engine(snapshot_budget_bytes=0)  # the dedicated model's live copy
    m = Learner(eng, _recipe({"old_logprob": "dedicated"})).step(_groups(eng), step=0).metrics
    assert m["old/held_bytes"] == m["old/dedicated_bytes"] == one


def test_recompute_is_exact_only_on_tokens_of_the_start_version():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute"}))
    learner.step(_groups(eng, seed=1), step=0)
    groups = _groups(eng, seed=2, first_id=10)
    samples = [s for g in groups for s in g.samples]
    samples[0].token_versions = [0] * samples[0].response_len
    m = learner.step(groups, step=1).metrics
    total = sum(s.response_len for s in samples)
    assert m["old/exact_frac"] == pytest.approx(1 - samples[0].response_len / total)
    assert m["mismatch/engine/exact"] == 0.0
    for strategy in ("ewma", "loglinear", "linear_prox", "bypass"):  # never exact
        eng = _engine()
        m = Learner(eng, _recipe({"old_logprob": strategy})).step(_groups(eng), step=0).metrics
        assert m["old/exact_frac"] == 0.0 and m["mismatch/engine/exact"] == 0.0, strategy


def test_ewma_reference_blend_and_reset_by_interval():
    eng = _engine()
    recipe = _recipe({"old_logprob": "ewma",
                      "ewma": {"staleness_window": 2.0, "reset_interval": 2,
                               "reset_mask_frac": None}})
    learner = Learner(eng, recipe, keep_tensors=True)
    init = _params(eng)
    res = learner.step(_groups(eng, seed=1), step=0)
    # step 1: the reference is the initial weights = the current weights
    assert torch.allclose(res.debug["old_log_prob"], res.debug["proximal_log_prob"], atol=1e-6)
    beta = 2.0 / (2.0 + 2.0)
    assert res.metrics["old/ewma_beta"] == pytest.approx(beta)
    assert res.metrics["old/ewma_updates_since_reset"] == 1.0
    assert res.metrics["old/ewma_resets"] == 0.0
    new = _params(eng)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert name in new
    ref = learner.old_policy.state.reference[name]
    assert torch.allclose(ref, beta * init[name] + (1 - beta) * new[name], atol=1e-7)
    assert not torch.equal(ref, new[name])

    res2 = learner.step(_groups(eng, seed=2, first_id=2), step=1)
    # seed 003 §5.2: the EWMA reference is both π_old and the clip centre π_prox, and it lags
    # the weights the step starts from
    assert torch.equal(res2.debug["old_log_prob"], res2.debug["proximal_log_prob"])
    assert not torch.allclose(res2.debug["old_log_prob"], res2.debug["current_log_prob"],
                              atol=1e-5)
    # reset_interval=2: the second update resets the reference to the current weights
    assert res2.metrics["old/ewma_resets"] == 1.0
    assert res2.metrics["old/ewma_updates_since_reset"] == 0.0
    assert torch.equal(learner.old_policy.state.reference[name], _params(eng)[name])


def test_ewma_old_matches_engine_under_reference_weights():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "ewma", "ewma": {"staleness_window": 1.0}}),
                      keep_tensors=True)
    learner.step(_groups(eng, seed=1), step=0)
    ref = {k: v.clone() for k, v in learner.old_policy.state.reference.items()}
    groups = _groups(eng, seed=2, first_id=2)
    res = learner.step(groups, step=1)
    samples = [s for g in groups for s in g.samples]
    probe = EmbeddedTrainEngine.from_config(eng.config, seed=5)
    with torch.no_grad():
        for n, p in probe.model.named_parameters():
            p.copy_(ref[n])
    want = probe.compute_log_probs(_batch_of(samples)).log_probs
    assert torch.allclose(res.debug["old_log_prob"], want, atol=1e-5)


def test_ewma_staleness_window_from_mode():
    assert ewma_staleness_window(_recipe()) == 0.0
    assert ewma_staleness_window(_recipe(**{"async": {"mode": "one_step"}})) == 1.0
    fa = _recipe(**{"async": {"mode": "fully_async", "staleness_threshold": 0.5,
                              "trigger_parameter_sync_step": 2}})
    assert ewma_staleness_window(fa) == 3.0
    assert ewma_staleness_window(_recipe({"ewma": {"staleness_window": 7.0}})) == 7.0


# ------------------------------------------------------------------------------------------------
# rejection of bad data
# ------------------------------------------------------------------------------------------------


def test_nan_rollout_log_prob_on_loss_token_rejects_without_touching_weights(caplog):
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute"}))
    groups = _groups(eng)
    groups[1].samples[1].rollout_log_probs[0] = float("nan")
    groups[0].samples[2].rollout_log_probs[1] = float("inf")
    before = _params(eng)
    with caplog.at_level(logging.WARNING, logger="asyncrl.runtime"):
        res = learner.step(groups, step=3)
    assert not res.trained
    assert "NaN" in res.rejected_reason and "2 samples" in res.rejected_reason
    assert "group 1 sample 1" in res.rejected_reason
    assert "\n" not in res.rejected_reason
    assert res.metrics["async/rejected_batch"] == 1.0
    assert res.weight_version == 0 == eng.weight_version
    after = _params(eng)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "rejected" in caplog.text


def test_nan_on_masked_token_trains_normally():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute"}))
    groups = _groups(eng)
    s = groups[1].samples[1]
    s.rollout_log_probs[0] = float("nan")
    s.loss_mask[0] = 0
    res = learner.step(groups, step=0)
    assert res.trained and eng.weight_version == 1
    _finite(res.metrics)


def test_inf_reward_rejected():
    eng = _engine()
    learner = Learner(eng, _recipe())
    groups = _groups(eng)
    groups[0].samples[0].reward = float("inf")
    res = learner.step(groups, step=0)
    assert not res.trained and "reward" in res.rejected_reason
    assert eng.weight_version == 0


def test_nonfinite_trainer_log_probs_rejected():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute"}))
    groups = _groups(eng)
    real = eng.compute_log_probs

    def poisoned(batch, **kw):
        res = real(batch, **kw)
        res.log_probs[0, 0] = float("nan")
        return res

    eng.compute_log_probs = poisoned
    before = _params(eng)
    res = learner.step(groups, step=0)
    assert not res.trained and "trainer" in res.rejected_reason
    assert "NaN" in res.rejected_reason
    assert all(torch.equal(before[k], v) for k, v in _params(eng).items())
    assert eng.weight_version == 0


def test_fewer_groups_than_minibatches_is_an_error():
    eng = _engine()
    learner = Learner(eng, _recipe(**{"async": {"mode": "sync", "require_batches": 3}}))
    with pytest.raises(ValueError, match="require_batches"):
        learner.step(_groups(eng, n_groups=2), step=0)


# ------------------------------------------------------------------------------------------------
# corrections
# ------------------------------------------------------------------------------------------------


def test_compis_engine_icepop_excludes_out_of_band_tokens():
    eng = _engine()
    recipe = _recipe({"old_logprob": "recompute",
                      "correction": {"kind": "compis", "engine": {"method": "icepop"}}})
    learner = Learner(eng, recipe, keep_tensors=True)
    groups = _groups(eng)
    hi = groups[0].samples[1]
    hi.rollout_log_probs[1] -= math.log(10.0)  # π_old/μ = 10 > 5
    lo = groups[1].samples[0]
    lo.rollout_log_probs[0] += math.log(5.0)  # π_old/μ = 0.2 < 0.5
    res = learner.step(groups, step=0)
    keep = res.debug["keep_mask"]
    assert not keep[1, 1] and not keep[3, 0]
    n_tok = sum(s.response_len for g in groups for s in g.samples)
    assert int(keep.sum()) == n_tok - 2
    assert res.metrics["is/combined/mask_frac"] == pytest.approx(2 / n_tok)  # applied
    assert res.metrics["is/engine/mask_frac"] == pytest.approx(2 / n_tok)  # measured
    assert res.metrics["is/staleness/mask_frac"] == 0.0
    assert res.metrics["is/engine/ratio/max"] == pytest.approx(10.0, rel=1e-4)
    assert res.debug["is_weights"][1, 1] == 0.0
    assert res.trained


def test_decoupled_m2po_opsm_metrics():
    eng = _engine()
    recipe = _recipe({"old_logprob": "recompute",
                      "correction": {"kind": "decoupled", "behaviour_weight_cap": 2.0},
                      "m2po": {"threshold": 0.04}, "opsm": {"delta": 1e-4}})
    learner = Learner(eng, recipe, keep_tensors=True)
    groups = _groups(eng)
    groups[0].samples[0].rollout_log_probs[0] -= 3.0  # behaviour weight e^3 > 2: capped
    res = learner.step(groups, step=0)
    assert not res.debug["keep_mask"][0, 0]
    n_tok = sum(s.response_len for g in groups for s in g.samples)
    # the behaviour weight π_prox/μ is the weight applied: is/combined/*, not is/staleness/*
    assert res.metrics["is/combined/mask_frac"] == pytest.approx(1 / n_tok)
    assert res.metrics["is/combined/ratio/max"] == pytest.approx(math.exp(3.0), rel=1e-4)
    for key in ("rs/m2po/mask_frac", "rs/m2po/m2/p99", "rs/opsm/masked_seq_frac",
                "rs/keep_frac"):
        assert key in res.metrics
    _finite(res.metrics)


@pytest.mark.parametrize("name", ["decoupled_token_is", "decoupled_geo_rs",
                                  "decoupled_token_icepop", "bypass_ppo_clip", "bypass_pg_is",
                                  "bypass_pg_geo_rs_token_tis"])
def test_presets_train_with_finite_loss(name):
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute",
                                    "correction": {"kind": "preset", "name": name}}),
                      keep_tensors=True)
    groups = _groups(eng, n_groups=2, n=2)
    for s in groups[0].samples:
        s.rollout_log_probs = [lp - 0.02 for lp in s.rollout_log_probs]
    res = learner.step(groups, step=0)
    assert res.trained and math.isfinite(res.metrics["train/loss"])
    _finite(res.metrics)
    if name.startswith("bypass"):
        assert isinstance(learner.old_policy, BypassOld)
        assert "policy/bypass/kept_token_frac" in res.metrics
        assert torch.equal(res.debug["proximal_log_prob"], res.debug["rollout_log_prob"])
    else:
        assert "rollout_corr/kl" in res.metrics or any(
            k.startswith("rollout_corr/") for k in res.metrics)


def test_bypass_mode_loss_needs_bypass_preset():
    with pytest.raises(ValueError, match="bypass"):
        Learner(_engine(), _recipe({"loss": {"name": "bypass_mode"}}))


# ------------------------------------------------------------------------------------------------
# mini-batches, advantages, KL
# ------------------------------------------------------------------------------------------------


def test_require_batches_and_epochs_count_optimizer_steps():
    eng = _engine()
    learner = Learner(eng, _recipe(**{"async": {"mode": "sync", "require_batches": 2}}))
    res = learner.step(_groups(eng, n_groups=4), step=0)
    assert res.weight_version == 2 and res.metrics["train/optimizer_steps"] == 2.0
    eng2 = _engine()
    learner2 = Learner(eng2, _recipe(**{"async": {"mode": "sync", "require_batches": 2},
                                        "optim": {"epochs": 2}}))
    res2 = learner2.step(_groups(eng2, n_groups=4), step=0)
    assert res2.weight_version == 4


def test_uneven_groups_last_minibatch_takes_remainder():
    eng = _engine()
    learner = Learner(eng, _recipe(**{"async": {"mode": "sync", "require_batches": 2}}))
    sizes, configs = [], []
    real = eng.train_step

    def record(batch, *a, **kw):
        sizes.append(batch.batch_size)
        configs.append(kw["config"])
        return real(batch, *a, **kw)

    eng.train_step = record
    learner.step(_groups(eng, n_groups=5, n=2), step=0)
    assert sizes == [4, 6]  # groups 0-1 and 2-4
    assert all(c is learner.plan.config for c in configs)  # built once, from the recipe


@pytest.mark.parametrize("correction", [None, "decoupled_token_is"])
def test_otb_reads_the_trainers_pi_and_sum_pi_squared_and_the_is_weights(correction):
    from training.algorithms.advantages import TokenPolicy, compute_advantage

    eng = _engine()
    alg = {"old_logprob": "recompute", "advantage": {"estimator": "optimal_token_baseline"}}
    if correction:
        alg["correction"] = {"kind": "preset", "name": correction}
    learner = Learner(eng, _recipe(alg), keep_tensors=True)
    groups = _groups(eng, n_groups=2, n=3)
    for s in groups[0].samples:  # μ ≠ π_old: IS weights ≠ 1 on group 0
        s.rollout_log_probs = [lp - 0.05 * (k % 3) for k, lp in enumerate(s.rollout_log_probs)]
    res = learner.step(groups, step=0)
    assert res.trained
    d = res.debug
    index = [0, 0, 0, 1, 1, 1]
    weights = d.get("is_weights")
    assert (weights is not None) == (correction is not None)
    expected, _, _ = compute_advantage(
        "optimal_token_baseline", d["token_level_rewards"], d["response_mask"], index,
        policy=TokenPolicy(d["current_log_prob"], d["sum_pi_squared"], weights))
    assert torch.equal(d["advantages"], expected)
    # Σπ² is the trainer's: between π² and 1 at every response token
    m = d["response_mask"].bool()
    pi = d["current_log_prob"].exp()
    assert bool((d["sum_pi_squared"][m] >= pi[m].square() - 1e-6).all())
    assert bool((d["sum_pi_squared"][m] <= 1 + 1e-6).all())
    if correction:  # the weights changed the baseline
        unweighted, _, _ = compute_advantage(
            "optimal_token_baseline", d["token_level_rewards"], d["response_mask"], index,
            policy=TokenPolicy(d["current_log_prob"], d["sum_pi_squared"]))
        assert not torch.allclose(unweighted, expected)


def test_zero_variance_group_gets_zero_advantage():
    eng = _engine()
    learner = Learner(eng, _recipe(), keep_tensors=True)
    groups = _groups(eng, rewards=[[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    res = learner.step(groups, step=0)
    adv = res.debug["advantages"]
    assert torch.equal(adv[:3], torch.zeros_like(adv[:3]))
    assert bool((adv[3:].abs() > 0).any())
    assert res.metrics["rollout/zero_variance_groups"] == 1.0
    assert res.metrics["rollout/zero_variance_group_frac"] == 0.5
    # reward on the last loss token
    rewards = res.debug["token_level_rewards"]
    s = groups[1].samples[1]
    assert rewards[4, s.response_len - 1] == 1.0 and float(rewards[4].sum()) == 1.0


def test_kl_in_reward_uses_reference_model(tmp_path):
    eng = _engine()
    eng.export_weights(tmp_path / "ref")
    recipe = _recipe({"old_logprob": "recompute",
                      "kl": {"mode": "in_reward", "coef": 0.1, "estimator": "k1"}})
    with pytest.raises(ValueError, match="reference"):
        Learner(eng, recipe)
    learner = Learner(eng, recipe, reference_dir=tmp_path / "ref", keep_tensors=True)
    res = learner.step(_groups(eng, seed=1), step=0)
    assert res.metrics["kl/value"] == pytest.approx(0.0, abs=1e-5)
    groups = _groups(eng, seed=2, first_id=2)
    res = learner.step(groups, step=1)
    d = res.debug
    kl = torch.where(d["response_mask"], d["old_log_prob"] - d["ref_log_prob"],
                     torch.zeros_like(d["old_log_prob"]))
    assert float(kl.abs().max()) > 1e-4
    assert res.metrics["kl/coef"] == 0.1
    expected = -0.1 * kl
    for i, s in enumerate(s for g in groups for s in g.samples):
        expected[i, s.response_len - 1] += s.reward
    assert torch.allclose(d["token_level_rewards"], expected, atol=1e-6)


def test_adaptive_kl_controller_moves_coef(tmp_path):
    eng = _engine()
    eng.export_weights(tmp_path / "ref")
    recipe = _recipe({"kl": {"mode": "in_reward", "coef": 0.1, "target": 1.0, "horizon": 10}})
    learner = Learner(eng, recipe, reference_dir=tmp_path / "ref")
    r1 = learner.step(_groups(eng, seed=1), step=0)
    r2 = learner.step(_groups(eng, seed=2, first_id=2), step=1)
    assert r1.metrics["kl/coef"] == 0.1
    assert r2.metrics["kl/coef"] < 0.1  # KL ≈ 0 ≪ target: β shrinks


# ------------------------------------------------------------------------------------------------
# MoE routing replay
# ------------------------------------------------------------------------------------------------


def test_moe_r3_replays_rollout_routes():
    eng = _engine(experts=4)
    learner = Learner(eng, _recipe({"routing_replay": "r3", "old_logprob": "snapshot"}, moe=True),
                      keep_tensors=True)
    groups = _groups(eng, routes=True)
    r = groups[0].samples[0].routes
    s = groups[0].samples[0]
    assert r.shape == (len(s.prompt_ids) + s.response_len - 1, 2, 2)
    res = learner.step(groups, step=0)
    assert res.trained and res.metrics["moe/replay_mode"] == 3.0
    assert res.metrics["mismatch/engine/logprob_abs_diff/max"] < 1e-5
    _finite(res.metrics)
    groups = _groups(eng, seed=4, first_id=2, routes=True)
    groups[1].samples[0].routes = None
    bad = learner.step(groups, step=1)
    assert not bad.trained and "routes" in bad.rejected_reason


def test_moe_r2_with_two_minibatches():
    eng = _engine(experts=4)
    learner = Learner(eng, _recipe({"routing_replay": "r2"}, moe=True,
                                   **{"async": {"mode": "sync", "require_batches": 2}}))
    res = learner.step(_groups(eng, n_groups=2), step=0)
    assert res.trained and res.weight_version == 2
    assert res.metrics["moe/replay_mode"] == 2.0


# ------------------------------------------------------------------------------------------------
# metrics and helpers
# ------------------------------------------------------------------------------------------------


def test_rollout_metrics_and_lag():
    eng = _engine()
    learner = Learner(eng, _recipe())
    learner.step(_groups(eng, seed=1), step=0)
    groups = _groups(eng, seed=2, first_id=2)
    samples = [s for g in groups for s in g.samples]
    samples[0].finish_reason = "length"
    samples[1].token_versions = [0] + [1] * (samples[1].response_len - 1)
    samples[2].response_ids = [5, 6, 7, 8, 5, 6, 7, 8]
    samples[2].rollout_log_probs = [-1.0] * 8
    samples[2].token_versions = [1] * 8
    samples[2].loss_mask = [1] * 8
    res = learner.step(groups, step=1, version_to_step=lambda v: v)
    m = res.metrics
    assert m["rollout/truncation_rate"] == pytest.approx(1 / 6)
    assert m["async/partial_samples"] == 1.0
    assert m["rollout/repetition_rate"] >= 1 / 6
    rewards = [s.reward for s in samples]
    assert m["rollout/reward_mean"] == pytest.approx(float(np.mean(rewards)))
    assert m["rollout/reward_std"] == pytest.approx(float(np.std(rewards)))
    assert m["rollout/reward_by_difficulty/0"] == pytest.approx(np.mean(rewards[:3]))
    assert m["rollout/reward_by_difficulty/1"] == pytest.approx(np.mean(rewards[3:]))
    lens = [s.response_len for s in samples]
    assert m["rollout/response_length/max"] == max(lens)
    assert m["rollout/response_length/mean"] == pytest.approx(np.mean(lens))
    assert m["async/batch_tokens"] == sum(len(s.prompt_ids) + s.response_len for s in samples)
    assert m["old/token_lag_steps/max"] == 1.0  # step 1 − version 0
    assert "moe/replay_mode" not in m


def test_repetition_rate_definition():
    assert repetition_rate([[1, 2, 3, 4, 1, 2, 3, 4]]) == 1.0
    assert repetition_rate([[1, 2, 3, 4, 5]]) == 0.0
    assert repetition_rate([[7, 7, 7, 7, 7], [1, 2, 3]]) == 0.5  # overlapping occurrences count
    assert repetition_rate([]) == 0.0


def test_engine_optim_config():
    cfg = engine_optim_config(_recipe(optim={"lr": 1e-3, "lr_schedule": "cosine",
                                             "warmup_steps": 2}, steps=5))
    assert cfg.lr == 1e-3 and cfg.total_steps == 5 and cfg.warmup_steps == 2


# ------------------------------------------------------------------------------------------------
# EmbeddedTrainEngine.compute_log_probs_with_weights
# ------------------------------------------------------------------------------------------------


def test_compute_log_probs_with_weights():
    eng = _engine()
    samples = [s for g in _groups(eng) for s in g.samples]
    batch = _batch_of(samples)
    w0 = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    same = eng.compute_log_probs_with_weights(batch, w0, with_entropy=True)
    ref = eng.compute_log_probs(batch)
    assert torch.allclose(same.log_probs, ref.log_probs, atol=1e-6)
    assert torch.allclose(same.entropy, ref.entropy, atol=1e-5)
    assert same.weight_version is None
    adv = torch.ones(batch.batch_size, batch.response_len)
    eng.train_step(batch, adv, ref.log_probs)
    v0 = eng.compute_log_probs(batch, version=0).log_probs  # loads v0 into the shadow
    eng.compute_log_probs_with_weights(batch, {k: v * 1.5 for k, v in w0.items()})
    # the shadow no longer holds v0: asking for it again reloads it
    assert torch.equal(eng.compute_log_probs(batch, version=0).log_probs, v0)
    assert torch.allclose(eng.compute_log_probs_with_weights(batch, w0).log_probs, v0, atol=1e-6)
    with pytest.raises(ValueError, match="missing"):
        eng.compute_log_probs_with_weights(batch, {k: v for k, v in list(w0.items())[1:]})
    with pytest.raises(ValueError, match="dense"):
        eng.compute_log_probs_with_weights(batch, w0, routing="r3")


def test_compute_log_probs_with_weights_moe_r2_needs_version():
    eng = _engine(experts=4)
    samples = [s for g in _groups(eng) for s in g.samples]
    batch = _batch_of(samples)
    w = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    with pytest.raises(ValueError, match="r2_version"):
        eng.compute_log_probs_with_weights(batch, w, routing="r2")
    free = eng.compute_log_probs(batch)
    r2 = eng.compute_log_probs_with_weights(batch, w, routing="r2", r2_version=0)
    assert torch.allclose(r2.log_probs, free.log_probs, atol=1e-6)
    assert len(r2.routes) == batch.batch_size


def test_traces_are_the_largest_gap_and_the_best_reward_with_their_token_values():
    """The step's traces: the trajectory with the largest train–rollout |Δlogp| on a loss token
    (μ perturbed by hand on one token of one sample), then the highest-reward other one; each
    token's gap, IS weight and staleness as the learner saw them."""
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "snapshot"}), keep_tensors=True)
    assert learner.step(_groups(eng, seed=1), step=0).trained  # version 0 → 1
    groups = _groups(eng, seed=2, first_id=10, rewards=[[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    samples = [s for g in groups for s in g.samples]
    target = samples[2]
    target.rollout_log_probs[1] -= 0.7  # a 0.7 gap on its second token
    target.token_versions = [0] * target.response_len  # generated one version back
    res = learner.step(groups, step=1)
    assert res.trained and len(res.traces) == 2
    worst, best = res.traces
    assert (worst.why, worst.group_id, worst.sample_index) == ("largest |Δlogp|", 10, 2)
    assert (best.why, best.group_id, best.sample_index, best.reward) == (
        "highest reward", 11, 1, 1.0)
    d = res.debug
    row = 2
    gap = (d["current_log_prob"][row] - d["rollout_log_prob"][row]).abs()
    assert worst.dlogp == pytest.approx(gap[: target.response_len].tolist(), abs=1e-5)
    assert worst.dlogp[1] == pytest.approx(0.7, abs=0.05)
    assert worst.staleness == (1,) * target.response_len  # start version 1 − token version 0
    assert best.staleness == (0,) * samples[4].response_len
    assert worst.is_weight == (1.0,) * target.response_len  # no correction configured
    assert worst.response_ids == tuple(target.response_ids)
    assert worst.loss_mask == (1,) * target.response_len


def test_trace_lines_are_bounded_and_readable(tmp_path):
    from training.runtime.traces import (
        MAX_TRACE_TOKENS,
        append_traces,
        read_traces,
        trace_every,
    )
    from training.runtime.types import RolloutTrace

    assert [trace_every(n) for n in (1, 100, 101, 1000)] == [1, 1, 2, 10]
    n = MAX_TRACE_TOKENS + 3
    t = RolloutTrace(why="highest reward", group_id=1, sample_index=0,
                     prompt_ids=(1, 10, 11), response_ids=(12,) * (n - 1) + (2,), reward=1.0,
                     finish_reason="stop", tool_calls=0, dlogp=(0.1,) * n, is_weight=(1.0,) * n,
                     staleness=(0,) * n, loss_mask=(1,) * (n - 1) + (0,))
    path = tmp_path / "rollouts.jsonl"
    append_traces(path, 3, [t])
    with open(path, "a") as f:
        f.write('{"step": 4, "tok')  # a line cut by a kill
    rows = read_traces(path)
    assert len(rows) == 1 and rows[0]["step"] == 3
    assert len(rows[0]["tokens"]) == MAX_TRACE_TOKENS and rows[0]["cut"] == 3
    from training.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    assert rows[0]["prompt"] == tok.decode([1, 10, 11]) and rows[0]["prompt"]
    assert rows[0]["tokens"][0] == {"t": tok.decode([12]), "d": 0.1, "w": 1.0, "s": 0, "obs": 0}
