"""Learner metrics that tell the mismatch sources apart (issue 14): train_rollout vs engine, the
exactness flag, measured per-source IS ratios, M2 tails and the gradient-variance proxies — each
checked against values computed by hand from the step's tensors."""

import dataclasses
import json
import math

import pytest
import torch

from training.algorithms.diagnostics import compute_mismatch_metrics
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.model import ModelConfig
from training.engines.train import OptimConfig, TokenBatch
from training.recipe import Recipe
from training.runtime.learner import Learner
from training.runtime.types import Group, RunCounters, Sample

V = 100
TR, EN = "mismatch/train_rollout/", "mismatch/engine/"
NOISE = 0.05  # the "engine mismatch" put on one token of μ


def _engine(**kw):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                      intermediate_size=40)
    kw.setdefault("optim", OptimConfig(lr=1e-2))
    return EmbeddedTrainEngine.from_config(cfg, seed=0, **kw)


def _recipe(algorithm=None, **sections):
    return Recipe.model_validate({"algorithm": algorithm or {}, "rollout": {"n": 3}, **sections})


def _batch_of(samples):
    return TokenBatch.from_sequences([s.prompt_ids for s in samples],
                                     [s.response_ids for s in samples],
                                     loss_masks=[s.loss_mask for s in samples])


def _groups(engine, seed=0, first_id=0, n_groups=2, n=3):
    """Groups sampled 'by' the engine's current version: μ = its own log-probs, except the first
    token of the first sample, NOISE below (one token of engine mismatch)."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(4, V, (k,), generator=g).tolist()

    v = engine.weight_version
    groups = []
    for gi in range(n_groups):
        prompt = [1, *ids(2, 6)]
        samples = []
        for j in range(n):
            response = [*ids(3, 8), 2]
            samples.append(Sample(
                group_id=first_id + gi, sample_index=j, prompt_id=f"p{first_id + gi}",
                prompt_ids=prompt, response_ids=response, rollout_log_probs=[0.0] * len(response),
                token_versions=[v] * len(response), loss_mask=[1] * len(response),
                reward=float((gi + j) % 2)))
        groups.append(Group(group_id=first_id + gi, prompt_id=f"p{first_id + gi}",
                            difficulty=None, answer="", submit_step=0, samples=samples))
    samples = [s for grp in groups for s in grp.samples]
    lp = engine.compute_log_probs(_batch_of(samples)).log_probs
    for i, s in enumerate(samples):
        s.rollout_log_probs = lp[i, : s.response_len].tolist()
    samples[0].rollout_log_probs[0] -= NOISE
    return groups


def _n_tokens(groups):
    return sum(s.response_len for g in groups for s in g.samples)


def _family(metrics, prefix):
    return {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}


def test_snapshot_with_lagged_batch_separates_staleness_from_engine_mismatch():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "snapshot"}), keep_tensors=True)
    lagged = _groups(eng, seed=5, first_id=10)  # sampled by version 0
    assert learner.step(_groups(eng, seed=1), step=0).trained  # the trainer moves to version 1
    res = learner.step(lagged, step=1)
    assert res.trained
    d, m = res.debug, res.metrics
    mask, mu = d["response_mask"], d["rollout_log_prob"]
    # π_old is version 0 itself: the engine family sees exactly the one noisy token
    n_tok = _n_tokens(lagged)
    assert m[EN + "logprob_abs_diff/mean"] == pytest.approx(NOISE / n_tok, abs=1e-6)
    assert m[EN + "logprob_abs_diff/max"] == pytest.approx(NOISE, abs=1e-5)
    assert m[EN + "logprob_abs_diff_seq/max"] == pytest.approx(
        NOISE / lagged[0].samples[0].response_len, abs=1e-6)
    assert m[EN + "exact"] == 1.0
    # ... and is |π_old − μ| itself, key for key
    by_hand = compute_mismatch_metrics(d["old_log_prob"], mu, mask, prefix=EN)
    assert {k: m[k] for k in by_hand} == pytest.approx(by_hand)
    # train_rollout adds the staleness (π_current at version 1 vs μ at version 0)
    assert m[TR + "logprob_abs_diff/mean"] > 2 * m[EN + "logprob_abs_diff/mean"]
    diff = (d["current_log_prob"] - mu).abs()[mask]
    assert m[TR + "logprob_abs_diff/mean"] == pytest.approx(float(diff.mean()), rel=1e-5)
    # measured staleness ratio π_current/π_old and engine ratio π_old/μ
    stale = torch.exp(d["current_log_prob"] - d["old_log_prob"])[mask]
    assert m["is/staleness/ratio/max"] == pytest.approx(float(stale.max()), rel=1e-5)
    assert m["is/staleness/weight_mean"] == pytest.approx(float(stale.mean()), rel=1e-5)
    assert m["is/engine/ratio/max"] == pytest.approx(math.exp(NOISE), rel=1e-5)
    assert m["is/engine/mask_frac"] == 0.0 and m["is/staleness/mask_frac"] == 0.0


def test_compis_under_ewma_logs_the_measured_staleness_not_its_own_unit_ratio():
    """Under ewma π_prox = π_old = π_EWMA, so CompIS's own staleness ratio π_prox/π_old is ≡ 1;
    is/staleness/* must be the measured π_current/π_EWMA (with CompIS's cap) instead."""
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "ewma", "ewma": {"staleness_window": 2.0},
                                    "correction": {"kind": "compis"}}), keep_tensors=True)
    lagged = _groups(eng, seed=5, first_id=10)
    assert learner.step(_groups(eng, seed=1), step=0).trained
    res = learner.step(lagged, step=1)
    d, m = res.debug, res.metrics
    mask = d["response_mask"]
    assert torch.equal(d["proximal_log_prob"], d["old_log_prob"])
    ratio = torch.exp(d["current_log_prob"] - d["old_log_prob"])[mask]
    assert float((ratio - 1.0).abs().max()) > 0.02  # the trainer has moved off the EWMA
    assert m["is/staleness/ratio/mean"] == pytest.approx(float(ratio.mean()), rel=1e-5)
    assert m["is/staleness/ratio/max"] == pytest.approx(float(ratio.max()), rel=1e-5)
    assert m["is/staleness/kl_k1"] == pytest.approx(
        float(-(d["current_log_prob"] - d["old_log_prob"])[mask].mean()), rel=1e-4, abs=1e-7)


def test_sync_recompute_both_families_agree_and_are_exact():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute"}), keep_tensors=True)
    groups = _groups(eng)
    res = learner.step(groups, step=0)
    m = res.metrics
    tr, en = _family(m, TR), _family(m, EN)
    assert en.pop("exact") == 1.0
    shared = {k: v for k, v in tr.items() if not k.startswith("logprob_abs_diff_high_entropy")}
    assert {k: en[k] for k in shared if k in en} == pytest.approx(
        {k: v for k, v in shared.items() if k in en})
    assert m[TR + "logprob_abs_diff/mean"] == pytest.approx(NOISE / _n_tokens(groups), abs=1e-6)
    # no staleness: π_current/π_old ≡ 1
    assert m["is/staleness/ratio/max"] == pytest.approx(1.0)
    assert m["is/staleness/kl_k1"] == pytest.approx(0.0, abs=1e-7)
    # the bare names are gone
    assert not [k for k in m if k.startswith("mismatch/")
                and not k.startswith((TR, EN))]


def test_recompute_on_a_lagged_batch_is_not_exact():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute"}))
    lagged = _groups(eng, seed=5, first_id=10)
    learner.step(_groups(eng, seed=1), step=0)
    m = learner.step(lagged, step=1).metrics
    assert m[EN + "exact"] == 0.0
    # π_old = π_current: the engine family carries the staleness too
    assert m[EN + "logprob_abs_diff/mean"] == pytest.approx(m[TR + "logprob_abs_diff/mean"])


def test_bypass_engine_family_reads_no_gap_and_is_not_exact():
    eng = _engine()
    m = Learner(eng, _recipe({"old_logprob": "bypass"})).step(_groups(eng), step=0).metrics
    assert m[EN + "exact"] == 0.0
    assert m[EN + "logprob_abs_diff/max"] == 0.0
    assert m[TR + "logprob_abs_diff/max"] == pytest.approx(NOISE, abs=1e-5)


def test_m2_tails_always_mask_only_with_m2po():
    eng = _engine()
    groups = _groups(eng)
    res = Learner(eng, _recipe(), keep_tensors=True).step(groups, step=0)
    d, m = res.debug, res.metrics
    m2 = ((d["proximal_log_prob"] - d["rollout_log_prob"]) ** 2)[d["response_mask"]]
    assert m["rs/m2po/m2_mean"] == pytest.approx(float(m2.mean()), rel=1e-5)
    assert m["rs/m2po/m2/max"] == pytest.approx(NOISE ** 2, rel=1e-3)
    assert "rs/m2po/mask_frac" not in m
    eng = _engine()
    on = Learner(eng, _recipe({"m2po": {"threshold": 0.04}})).step(_groups(eng), step=0)
    assert "rs/m2po/mask_frac" in on.metrics


def test_variance_proxies_hand_computed_over_two_mini_batches():
    eng = _engine()
    groups = _groups(eng, n_groups=4)
    samples = [s for g in groups for s in g.samples]
    s2 = eng.compute_log_probs(_batch_of(samples)).sum_pi_squared  # π_current's Σπ²
    recipe = _recipe(**{"async": {"mode": "sync", "require_batches": 2}})
    learner = Learner(eng, recipe, keep_tensors=True)
    res = learner.step(groups, step=0)
    d, m = res.debug, res.metrics
    assert m["train/optimizer_steps"] == 2.0
    # proxy1 = mean of the two pre-clip ‖g‖²; from their mean and max: g = (max, 2·mean − max)
    g_max, g_mean = m["policy/grad_norm_max"], m["policy/grad_norm"]
    p1 = (g_max ** 2 + (2 * g_mean - g_max) ** 2) / 2
    assert m["policy/proxy1_signal_strength"] == pytest.approx(p1, rel=1e-6)
    # proxy2 = mean over sequences of Ā² · W (no IS weights: ρ̄ = 1), W = Σ_t 1 − 2π + Σπ²
    keep, adv = d["keep_mask"], d["advantages"]
    p = d["current_log_prob"].exp()
    terms = []
    for i in range(len(samples)):
        toks = keep[i].nonzero().reshape(-1).tolist()
        a_bar = sum(float(adv[i, t]) for t in toks) / len(toks)
        w = sum(1 - 2 * float(p[i, t]) + float(s2[i, t]) for t in toks)
        terms.append(a_bar ** 2 * max(w, 0.0))
    p2 = sum(terms) / len(terms)
    assert m["policy/proxy2_total_power"] == pytest.approx(p2, rel=1e-5)
    n = len(samples) / 2  # sequences per mini-batch
    assert m["policy/proxy3_pure_noise"] == pytest.approx(max(0.0, (p2 - p1) / (n - 1)),
                                                          rel=1e-5, abs=1e-12)
    assert p2 > 0


def test_proxies_use_the_applied_is_weights():
    eng = _engine()
    groups = _groups(eng)
    samples = [s for g in groups for s in g.samples]
    s2 = eng.compute_log_probs(_batch_of(samples)).sum_pi_squared
    recipe = _recipe({"old_logprob": "recompute", "correction": {
        "kind": "compis", "engine": {"method": "clip", "lower": 0.5, "upper": 2.0}}})
    res = Learner(eng, recipe, keep_tensors=True).step(groups, step=0)
    d, m = res.debug, res.metrics
    w, keep, adv = d["is_weights"], d["keep_mask"], d["advantages"]
    assert float(w[0, 0]) == pytest.approx(math.exp(NOISE), rel=1e-5)
    p = d["current_log_prob"].exp()
    terms = []
    for i in range(len(samples)):
        k = keep[i]
        rho = float(w[i][k].mean())
        a_bar = float(adv[i][k].mean())
        wi = float((1 - 2 * p[i][k] + s2[i][k]).sum())
        terms.append(rho ** 2 * a_bar ** 2 * wi)
    assert m["policy/proxy2_total_power"] == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def test_dropped_stale_frac_is_cumulative_share_of_responses():
    assert RunCounters().dropped_stale_frac == 0.0
    assert RunCounters(dropped_stale_samples=3, trained_samples=9).dropped_stale_frac == 0.25
    assert RunCounters(dropped_stale_samples=2).dropped_stale_frac == 1.0


def test_run_counters_round_trip_and_report_as_run_metrics():
    c = RunCounters(trained_samples=48, trained_tokens=600, wall_time_s=12.0)
    again = RunCounters.from_json(json.loads(json.dumps(dataclasses.asdict(c))))
    assert again == c and isinstance(again.trained_samples, int)
    m = c.metrics()
    assert m["run/trained_samples"] == 48.0 and m["run/trained_tokens_per_s"] == 50.0
    assert set(m) == {f"run/{f.name}" for f in dataclasses.fields(c)} | {
        "run/trained_tokens_per_s"}
    # a runtime.json written before a counter existed: it starts at 0; floats read as written
    old = RunCounters.from_json({"trained_samples": 16.0, "wall_time_s": 3})
    assert old.trained_samples == 16 and old.wall_time_s == 3.0 and old.sync_wait_s == 0.0


def test_update_size_is_the_start_weights_against_the_new_ones_on_the_trained_tokens():
    """policy/update/* and policy/update_kl (issue 26): the step's own move, measured by one more
    forward at the new weights; equal to a hand recompute, non-zero after a real update."""
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute"}), keep_tensors=True)
    groups = _groups(eng, seed=3)
    res = learner.step(groups, step=0)
    assert res.trained
    d, m = res.debug, res.metrics
    mask = d["response_mask"]
    after = eng.compute_log_probs(_batch_of([s for g in groups for s in g.samples])).log_probs
    delta = after - d["current_log_prob"]
    assert m["policy/update/logprob_abs_diff/mean"] == pytest.approx(
        float(delta.abs()[mask].mean()), rel=1e-5)
    assert m["policy/update/logprob_abs_diff/max"] == pytest.approx(
        float(delta.abs()[mask].max()), rel=1e-5)
    k3 = (torch.exp(delta) - delta - 1.0)[mask].mean()
    assert m["policy/update_kl"] == pytest.approx(float(k3), rel=1e-4)
    assert m["policy/update_kl"] > 0.0 and m["policy/update/logprob_abs_diff/mean"] > 1e-4
    # recompute has no distinct π_old: no staleness component is claimed
    assert not [k for k in m if k.startswith("mismatch/staleness/")]


def test_snapshot_logs_the_staleness_component_alone():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "snapshot"}), keep_tensors=True)
    lagged = _groups(eng, seed=5, first_id=10)
    first = learner.step(_groups(eng, seed=1), step=0)
    res = learner.step(lagged, step=1)
    d, m = res.debug, res.metrics
    mask = d["response_mask"]
    stale = (d["current_log_prob"] - d["old_log_prob"]).abs()[mask]
    assert m["mismatch/staleness/logprob_abs_diff/mean"] == pytest.approx(
        float(stale.mean()), rel=1e-5)
    # one update of lag: the staleness this step sees is the update the step before made
    assert m["mismatch/staleness/logprob_abs_diff/mean"] > 0.0
    assert first.metrics["mismatch/staleness/logprob_abs_diff/mean"] == pytest.approx(0.0,
                                                                                        abs=1e-7)
