"""Correction wiring: which (π_prox, π_old) each old-log-prob strategy gives, which ratio each
correction kind's weight is, the refused combinations, the EWMA mask reset and Dr.GRPO's constant.

The matrix tests use hand-built (B, T) log-probs with distinct per-token values, so a weight
built from the wrong pair of policies cannot match the expected one.
"""

import math

import pytest
import torch

from training.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig
from training.algorithms.rollout_correction import PRESETS
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.model import ModelConfig
from training.engines.train import OptimConfig, StepConfig, TokenBatch
from training.recipe import OLD_LOGPROB_STRATEGIES, RecipeError, recipe_from_dict
from training.runtime.learner import (
    Learner,
    apply_correction,
    build_step,
    policy_loss_config,
)
from training.runtime.old_policy import proximal_and_old
from training.runtime.types import Group, Sample

V = 100  # vocabulary of the tiny trainers (the character tokenizer's size)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
MU = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.7, -1.2, -2.2, 0.0]], dtype=torch.float64)
CURRENT = MU + torch.tensor([[0.2, -0.1, 0.3, 0.05], [-0.25, 0.15, 0.1, 0.0]],
                            dtype=torch.float64)
# the strategy's own policy: exact π_old (snapshot), the EWMA reference, the A-3PO interpolation
REFERENCE = MU + torch.tensor([[0.1, 0.05, -0.2, 0.12], [0.3, -0.05, 0.2, 0.0]],
                              dtype=torch.float64)
NAMED = {"current": CURRENT, "reference": REFERENCE, "mu": MU}

# strategy → (π_prox, π_old) by name (contract of issue 14; seed 003)
POLICIES = {
    "recompute": ("current", "current"),
    "snapshot": ("current", "reference"),
    "dedicated": ("current", "reference"),
    "interrupt": ("current", "reference"),
    "ewma": ("reference", "reference"),
    "loglinear": ("reference", "mu"),
    "linear_prox": ("reference", "mu"),
    "bypass": ("mu", "mu"),
}

# each kind with bounds that bite on some token of some strategy
KINDS = {
    "none": {"kind": "none"},
    "compis": {"kind": "compis", "staleness": {"method": "clip", "lower": 0.0, "upper": 1.0},
               "engine": {"method": "clip", "upper": 1.05}},
    "preset": {"kind": "preset", "name": "decoupled_token_is", "args": {"threshold": 1.1}},
    "decoupled": {"kind": "decoupled", "behaviour_weight_cap": 1.2},
    "decoupled_mis": {"kind": "decoupled_mis",
                      "engine": {"method": "icepop", "lower": 0.9, "upper": 1.15}},
}

REFUSED = {("bypass", "compis"), ("bypass", "preset"), ("bypass", "decoupled"),
           ("bypass", "decoupled_mis"), ("loglinear", "decoupled_mis"),
           ("linear_prox", "decoupled_mis")}


def _expected(kind: str, prox: torch.Tensor, old: torch.Tensor):
    """(weight or None, keep) of ``kind`` written out from the ratios themselves."""
    if kind == "none":
        return None, MASK
    if kind == "compis":  # f_s(π_prox/π_old) · f_e(π_old/μ)
        return (prox - old).exp().clamp(max=1.0) * (old - MU).exp().clamp(max=1.05), MASK
    if kind == "preset":  # token TIS of π_prox/μ
        return (prox - MU).exp().clamp(max=1.1), MASK
    if kind == "decoupled":  # π_prox/μ, masked above the cap
        r = (prox - MU).exp()
        keep = MASK & (r <= 1.2)
        return torch.where(keep, r, torch.zeros_like(r)), keep
    r = (old - MU).exp()  # decoupled_mis: IcePop on π_old/μ
    keep = MASK & (r >= 0.9) & (r <= 1.15)
    return torch.where(keep, r, torch.zeros_like(r)), keep


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("strategy", OLD_LOGPROB_STRATEGIES)
def test_strategy_and_kind_give_the_documented_centre_and_weight(strategy, kind):
    data = {"algorithm": {"old_logprob": strategy, "correction": KINDS[kind]}}
    if (strategy, kind) in REFUSED:
        with pytest.raises(RecipeError) as info:
            recipe_from_dict(data)
        msg = str(info.value)
        assert msg.startswith("recipe: algorithm: ") and "\n" not in msg
        assert "use old_logprob: snapshot" in msg or "use correction kind none" in msg
        return
    correction = recipe_from_dict(data).algorithm.correction
    prox, old = proximal_and_old(strategy, kind, CURRENT, MU, REFERENCE)
    prox_name, old_name = POLICIES[strategy]
    if kind == "decoupled_mis":  # seed 003 Eq. 4: the clip is centred at π_old
        prox_name = old_name
    assert torch.equal(prox, NAMED[prox_name]) and torch.equal(old, NAMED[old_name])

    preset = PRESETS[correction.name](**correction.args) if kind == "preset" else None
    applied = apply_correction(correction, preset, prox, old, MU, MASK)
    weight, keep = _expected(kind, NAMED[prox_name], NAMED[old_name])
    assert torch.equal(applied.keep, keep)
    if weight is None:
        assert applied.weights is None
        assert not any(k.startswith("is/combined/") for k in applied.metrics)
        return
    w = torch.where(MASK, weight, torch.zeros_like(weight))
    assert torch.allclose(applied.weights.to(torch.float64), w, atol=1e-6)
    n = int(MASK.sum())
    m = applied.metrics
    assert m["is/combined/weight_mean"] == pytest.approx(float(w[MASK].mean()), abs=1e-6)
    assert m["is/combined/mask_frac"] == pytest.approx(
        int((MASK & ((w == 0) | ~keep)).sum()) / n)
    normalised = w[MASK] / w[MASK].mean()
    assert m["is/combined/ess"] == pytest.approx(float(1 / (normalised**2).mean()), rel=1e-5)
    assert not any(k.startswith(("is/staleness/", "is/engine/")) for k in m)


def test_the_matrix_bites():
    """The bounds above are not vacuous: the wiring changes which tokens survive."""
    decoupled = recipe_from_dict({"algorithm": {"correction": KINDS["decoupled"]}})
    snap = apply_correction(decoupled.algorithm.correction, None, CURRENT, REFERENCE, MU, MASK)
    ewma = apply_correction(decoupled.algorithm.correction, None, REFERENCE, REFERENCE, MU, MASK)
    # π_prox/μ > 1.2: e^0.2 and e^0.3 of the first row under snapshot, of the second under ewma
    assert (~snap.keep & MASK).nonzero().tolist() == [[0, 0], [0, 2]]
    assert (~ewma.keep & MASK).nonzero().tolist() == [[1, 0], [1, 2]]
    mis = recipe_from_dict({"algorithm": {"correction": KINDS["decoupled_mis"]}})
    out = apply_correction(mis.algorithm.correction, None, REFERENCE, REFERENCE, MU, MASK)
    assert out.metrics["is/combined/mask_frac"] == pytest.approx(3 / 7)


def test_bypass_presets_and_no_correction_are_allowed_with_bypass():
    for correction in ({"kind": "none"}, {"kind": "preset", "name": "bypass_ppo_clip"},
                       {"kind": "preset", "name": "bypass_pg_is", "args": {"threshold": 3.0}}):
        r = recipe_from_dict({"algorithm": {"old_logprob": "bypass", "correction": correction}})
        assert r.algorithm.correction.kind == correction["kind"]


def test_bypass_preset_applies_no_weight_before_the_loss():
    spec = recipe_from_dict({"algorithm": {"correction": {
        "kind": "preset", "name": "bypass_pg_is"}}}).algorithm.correction
    out = apply_correction(spec, PRESETS["bypass_pg_is"](), MU, MU, MU, MASK)
    assert out.weights is None and torch.equal(out.keep, MASK) and out.metrics == {}


def test_decoupled_preset_under_snapshot_weighs_the_lag():
    """Issue 14's synthetic check: exact π_old (= μ up to engine noise), π_current lagged ahead.
    The decoupled preset's weight is π_prox/μ, mean ≈ E[π_prox/μ] — not ≈ 1 as π_old/μ would
    give (the lag would be invisible to it)."""
    g = torch.Generator().manual_seed(0)
    shape = (64, 32)
    mask = torch.ones(shape, dtype=torch.bool)
    mu = -torch.rand(shape, generator=g, dtype=torch.float64) * 3 - 0.1
    old = mu + 1e-3 * torch.randn(shape, generator=g, dtype=torch.float64)
    current = old + 0.2 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
    prox, pi_old = proximal_and_old("snapshot", "preset", current, mu, old)
    spec = recipe_from_dict({"algorithm": {"correction": {
        "kind": "preset", "name": "decoupled_token_is"}}}).algorithm.correction
    out = apply_correction(spec, PRESETS["decoupled_token_is"](), prox, pi_old, mu, mask)
    want = float((current - mu).exp().clamp(max=2.0).mean())
    assert want == pytest.approx(math.exp(0.2 + 0.1**2 / 2), rel=0.02)  # ≈ 1.23
    assert out.metrics["is/combined/weight_mean"] == pytest.approx(want, rel=1e-6)
    assert float(out.weights.mean()) == pytest.approx(want, rel=1e-6)
    # the weight π_old/μ of the old wiring reads ≈ 1
    stale_blind = apply_correction(spec, PRESETS["decoupled_token_is"](), pi_old, pi_old, mu,
                                   mask)
    assert stale_blind.metrics["is/combined/weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_decoupled_rejection_only_preset_reports_its_mask_as_the_applied_weight():
    """A preset with RS and no IS weight still logs is/combined/* (weight 1 on the kept tokens),
    so is_health and the decision tree see its mask."""
    spec = recipe_from_dict({"algorithm": {"correction": {
        "kind": "preset", "name": "decoupled_geo_rs",
        "args": {"rs_threshold": "0.99_1.01"}}}}).algorithm.correction
    preset = PRESETS["decoupled_geo_rs"](**spec.args)
    out = apply_correction(spec, preset, CURRENT, CURRENT, MU, MASK)
    assert out.weights is None
    m = out.metrics
    # the first sequence's geometric-mean ratio e^0.1125 leaves [0.99, 1.01], the second's
    # e^0 does not: 4 of the 7 loss tokens rejected
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 7)
    assert m["is/combined/mask_frac"] == pytest.approx(
        m["rollout_corr/rollout_rs_masked_fraction"])
    assert m["is/combined/weight_mean"] == pytest.approx(3 / 7)
    assert m["is/combined/ess"] == pytest.approx(3 / 7)


def test_unprovided_advantage_estimators_are_refused():
    for name, fix in (("gae", "grpo, rloo or reinforce_plus_plus"), ("remax", "rloo")):
        with pytest.raises(RecipeError) as info:
            recipe_from_dict({"algorithm": {"advantage": {"estimator": name}}})
        msg = str(info.value)
        assert msg.startswith(f"recipe: algorithm.advantage.estimator: {name} needs ")
        assert fix in msg and "\n" not in msg


# ------------------------------------------------------------------------------------------------
# Dr.GRPO's constant
# ------------------------------------------------------------------------------------------------


def _padded(width: int):
    """One 4-token sequence (log-probs, advantages, mask) padded to ``width``."""
    lp = torch.full((1, width), 0.0, dtype=torch.float64)
    lp[0, :4] = torch.tensor([-0.5, -1.0, -0.2, -2.0], dtype=torch.float64)
    adv = torch.zeros((1, width), dtype=torch.float64)
    adv[0, :4] = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    mask = torch.zeros((1, width), dtype=torch.bool)
    mask[0, :4] = True
    return lp, adv, mask


def test_dr_grpo_loss_does_not_depend_on_the_padded_width():
    recipe = recipe_from_dict({"algorithm": {"loss": {"agg": "seq-mean-token-sum-norm"}},
                               "rollout": {"max_response_tokens": 16}})
    cfg = policy_loss_config(recipe)
    assert cfg.loss_scale_factor == 16.0
    vanilla = POLICY_LOSSES.get("vanilla")
    losses = {}
    for width in (4, 8):
        lp, adv, mask = _padded(width)
        old = lp - 0.05  # ratio e^0.05 inside the clip
        losses[width], _ = vanilla(old, lp, adv, mask, cfg)
    # −Σ_t r·A / K with r = e^0.05, Σ A = 2.75, K = 16
    assert float(losses[4]) == pytest.approx(-math.exp(0.05) * 2.75 / 16)
    assert float(losses[8]) == pytest.approx(float(losses[4]), rel=1e-12)
    # without the constant, the padded width sets the scale: the same sequence, half the loss
    bare = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm")
    by_width = {w: float(vanilla(_padded(w)[0] - 0.05, *_padded(w), bare)[0]) for w in (4, 8)}
    assert by_width[8] == pytest.approx(by_width[4] / 2)


def test_loss_scale_factor_overrides_the_response_cap():
    recipe = recipe_from_dict({"algorithm": {"loss": {"agg": "seq-mean-token-sum-norm",
                                                      "loss_scale_factor": 100.0}}})
    assert policy_loss_config(recipe).loss_scale_factor == 100.0
    assert policy_loss_config(recipe_from_dict({})).loss_scale_factor == 32.0  # the default cap


def test_step_config_is_the_recipes_train_settings():
    recipe = recipe_from_dict({
        "model": {"kind": "warmstart", "moe_experts": 4},
        "algorithm": {"routing_replay": "r2", "loss": {"name": "gspo", "entropy_coeff": 0.01}},
        "rollout": {"temperature": 0.7}, "optim": {"micro_batch_size": 4}})
    assert build_step(recipe).config == StepConfig(
        loss_name="gspo", loss_config=policy_loss_config(recipe), routing="r2", temperature=0.7,
        micro_batch_size=4, entropy_coeff=0.01, accumulation="scaled")
    assert build_step(recipe_from_dict({"model": {"kind": "warmstart", "moe_experts": 4},
                                        "algorithm": {"routing_replay": "none"}})
                      ).config.routing == "free"
    # a bypass preset trains bypass_mode with the preset's IS/RS settings
    bypass = recipe_from_dict({"algorithm": {"correction": {"kind": "preset",
                                                            "name": "bypass_ppo_clip"}}})
    cfg = build_step(bypass).config
    assert cfg.loss_name == "bypass_mode"
    assert cfg.loss_config == policy_loss_config(bypass, PRESETS["bypass_ppo_clip"]())


def test_dr_grpo_engine_step_loss_is_the_same_at_two_padded_widths():
    """Through the trainer: the 4-token sequence alone, and batched with a loss-masked 8-token
    one (padded width 8, two micro-batches), gives the same policy loss."""
    cfg = ModelConfig(vocab_size=V, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                      intermediate_size=24)
    recipe = recipe_from_dict({"algorithm": {"loss": {"agg": "seq-mean-token-sum-norm"}}})
    loss_cfg = policy_loss_config(recipe)
    losses = []
    for extra in (False, True):
        eng = EmbeddedTrainEngine.from_config(cfg, seed=0, optim=OptimConfig(lr=1e-3))
        prompts, responses, masks = [[1, 5, 6]], [[7, 8, 9, 2]], [[1, 1, 1, 1]]
        if extra:
            prompts.append([1, 4])
            responses.append([10, 11, 12, 13, 14, 15, 16, 2])
            masks.append([0] * 8)
        batch = TokenBatch.from_sequences(prompts, responses, loss_masks=masks)
        old = eng.compute_log_probs(batch).log_probs - 0.05
        adv = torch.zeros(old.shape)
        adv[0, :4] = torch.tensor([1.0, -0.5, 0.25, 2.0])
        m = eng.train_step(batch, adv, old, config=StepConfig(
            loss_name="vanilla", loss_config=loss_cfg, micro_batch_size=1))
        losses.append(m["train/pg_loss"])
    assert losses[0] == pytest.approx(-math.exp(0.05) * 2.75 / 32, rel=1e-4)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


# ------------------------------------------------------------------------------------------------
# Through the learner
# ------------------------------------------------------------------------------------------------


def _engine():
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                      intermediate_size=40)
    return EmbeddedTrainEngine.from_config(cfg, seed=0, optim=OptimConfig(lr=1e-2))


def _groups(engine, seed, first_id=0, n_groups=2, n=3):
    """Groups whose rollout log-probs are the engine's own at its current weights."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        prompt = [1, *torch.randint(4, V, (3,), generator=g).tolist()]
        samples = []
        for j in range(n):
            response = [*torch.randint(4, V, (5,), generator=g).tolist(), 2]
            samples.append(Sample(
                group_id=first_id + gi, sample_index=j, prompt_id=f"p{first_id + gi}",
                prompt_ids=prompt, response_ids=response, rollout_log_probs=[0.0] * 6,
                token_versions=[engine.weight_version] * 6, loss_mask=[1] * 6,
                reward=float((gi + j) % 2)))
        groups.append(Group(group_id=first_id + gi, prompt_id=f"p{first_id + gi}", difficulty=0,
                            answer="", submit_step=0, samples=samples))
    samples = [s for grp in groups for s in grp.samples]
    batch = TokenBatch.from_sequences([s.prompt_ids for s in samples],
                                      [s.response_ids for s in samples],
                                      loss_masks=[s.loss_mask for s in samples])
    lps = engine.compute_log_probs(batch).log_probs
    for i, s in enumerate(samples):
        s.rollout_log_probs = lps[i, :6].tolist()
    return groups


def _recipe(algorithm):
    return recipe_from_dict({"algorithm": algorithm, "rollout": {"n": 3}})


def test_learner_snapshot_decoupled_mis_centres_the_clip_at_the_exact_old_policy():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "snapshot",
                                    "correction": {"kind": "decoupled_mis"}}), keep_tensors=True)
    assert learner.step(_groups(eng, seed=1), step=0).trained  # weights move to version 1
    groups = _groups(eng, seed=2, first_id=2)
    for s in (s for g in groups for s in g.samples):
        s.token_versions = [0] * 6  # generated by version 0: μ is not even the engine's
    res = learner.step(groups, step=1)
    d = res.debug
    assert torch.equal(d["proximal_log_prob"], d["old_log_prob"])
    assert not torch.allclose(d["old_log_prob"], d["current_log_prob"], atol=1e-4)
    # the IcePop weight is π_old/μ on the kept tokens
    ratio = (d["old_log_prob"] - d["rollout_log_prob"]).exp()
    keep = d["keep_mask"]
    assert torch.allclose(d["is_weights"][keep], ratio[keep], atol=1e-6)
    assert res.metrics["is/combined/mask_frac"] == pytest.approx(
        float(((ratio < 0.5) | (ratio > 5.0)).float().mean()))
    assert res.metrics["is/combined/weight_mean"] == pytest.approx(
        float(d["is_weights"].mean()), abs=1e-6)


def test_learner_ewma_resets_on_the_correction_mask_rate():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "ewma",
                                    "ewma": {"staleness_window": 2.0, "reset_mask_frac": 0.1},
                                    "correction": {"kind": "decoupled_mis"}}))
    groups = _groups(eng, seed=3)  # 36 loss tokens; the reference = the current weights
    samples = [s for g in groups for s in g.samples]
    for s in samples[:3]:  # 3/36 < 0.1 outside the band: no reset
        s.rollout_log_probs[0] -= math.log(10.0)
    res = learner.step(groups, step=0)
    assert res.metrics["old/ewma_mask_frac"] == pytest.approx(3 / 36)
    assert res.metrics["old/ewma_resets"] == 0.0
    assert res.metrics["old/ewma_updates_since_reset"] == 1.0
    groups = _groups(eng, seed=4, first_id=2)
    for s in [s for g in groups for s in g.samples][:5]:  # > 0.1 of the tokens: reset
        s.rollout_log_probs[1] -= math.log(10.0)
    res = learner.step(groups, step=1)
    assert res.metrics["old/ewma_mask_frac"] >= 5 / 36
    assert res.metrics["old/ewma_resets"] == 1.0
    assert res.metrics["old/ewma_updates_since_reset"] == 0.0


def test_learner_ewma_without_a_mask_measures_the_icepop_band():
    """Correction none rejects nothing: the reset reads the fraction of π_old/μ outside the
    default IcePop band [0.5, 5] instead (or it could never fire)."""
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "ewma", "ewma": {"reset_mask_frac": 0.1}}))
    groups = _groups(eng, seed=5)
    for s in [s for g in groups for s in g.samples][:4]:
        s.rollout_log_probs[2] += math.log(4.0)  # π_old/μ = 0.25 < 0.5
    res = learner.step(groups, step=0)
    assert res.metrics["old/ewma_mask_frac"] == pytest.approx(4 / 36)
    assert res.metrics["old/ewma_resets"] == 1.0
    assert "is/combined/weight_mean" not in res.metrics


def test_learner_builds_the_preset_with_its_args():
    eng = _engine()
    learner = Learner(eng, _recipe({"old_logprob": "recompute", "correction": {
        "kind": "preset", "name": "decoupled_token_is", "args": {"threshold": 1.5}}}),
        keep_tensors=True)
    groups = _groups(eng, seed=6)
    groups[0].samples[0].rollout_log_probs[0] -= 1.0  # π_prox/μ = e > 1.5: truncated
    res = learner.step(groups, step=0)
    assert res.debug["is_weights"][0, 0] == pytest.approx(1.5)
    assert res.metrics["is/combined/weight_mean"] == pytest.approx(
        float(res.debug["is_weights"].mean()), abs=1e-6)
