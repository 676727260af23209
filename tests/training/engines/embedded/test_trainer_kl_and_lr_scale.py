"""The train step's KL-to-reference loss term (StepConfig.kl_*, ``ref_log_prob``) and its
per-step learning-rate factor (``lr_scale``) on the embedded engine, checked by hand."""

import pytest
import torch

from training.algorithms.kl import kl_loss_term
from training.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig, agg_loss
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.model import ModelConfig
from training.engines.train import OptimConfig, StepConfig, TokenBatch

V = 100


def _engine(lr=1e-3):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=40)
    return EmbeddedTrainEngine.from_config(cfg, seed=0, optim=OptimConfig(lr=lr, grad_clip=None))


def _batch(n=5, seed=1):
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(4, V, (k,), generator=g).tolist()

    return TokenBatch.from_sequences([[1, *ids(1, 5)] for _ in range(n)],
                                     [[*ids(1, 6), 2] for _ in range(n)])


def _noise(batch, seed):
    g = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(batch.batch_size, batch.response_len, generator=g)


def _capture_grads(engine):
    grads = {}

    def record(*_a, **_k):
        grads.update({n: p.grad.clone() for n, p in engine.model.named_parameters()
                      if p.grad is not None})

    engine._optimizer.step = record
    return grads


@pytest.mark.parametrize("is_correction", ["none", "clipped", "deepseek_k3"])
def test_kl_loss_term_is_added_with_its_gradient_whatever_the_micro_batching(is_correction):
    batch = _batch()
    mask = batch.response_mask
    adv = _noise(batch, 2) * 10
    eng = _engine()
    now = eng.compute_log_probs(batch).log_probs
    old, ref = now + _noise(batch, 3), now - _noise(batch, 4)  # ρ ≠ 1, π_θ ≠ π_ref
    isw = 1.0 + _noise(batch, 5).abs()

    # by hand: autograd of pg + β·agg(term) on the whole batch
    logits, _ = eng.model(batch.input_ids, attention_mask=batch.attention_mask)
    pos = (batch.prompt_lens[:, None] - 1 + torch.arange(batch.response_len)).clamp(
        max=batch.seq_len - 1)
    logp = torch.log_softmax(logits.gather(1, pos[..., None].expand(-1, -1, V)), -1)
    lp = torch.where(mask, logp.gather(-1, batch.responses[..., None]).squeeze(-1), 0.0)
    cfg = PolicyLossConfig(clip_ratio=0.2)
    pg, _ = POLICY_LOSSES.get("vanilla")(old, lp, adv, mask, cfg, isw)
    term, _ = kl_loss_term(lp, old, ref, mask, "k3", is_correction, clip_ratio_low=0.2,
                           clip_ratio_high=0.2, rollout_is_weights=isw)
    kl = agg_loss(term, mask, "token-mean")
    (pg + 0.5 * kl).backward()
    expected = {n: p.grad for n, p in eng.model.named_parameters()}
    assert float(kl.detach()) > 0

    for mbs in (None, 2):
        e = _engine()
        grads = _capture_grads(e)
        m = e.train_step(batch, adv, old, rollout_is_weights=isw, ref_log_prob=ref,
                         config=StepConfig(loss_config=cfg, micro_batch_size=mbs,
                                           kl_estimator="k3", kl_coef=0.5,
                                           kl_is_correction=is_correction))
        total = float((pg + 0.5 * kl).detach())
        torch.testing.assert_close(m["train/loss"], total, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(m["train/pg_loss"], float(pg.detach()), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(m["policy/kl_loss"], float(kl.detach()), atol=1e-6, rtol=1e-5)
        assert m["policy/kl_coef"] == 0.5
        for n, g in expected.items():
            torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5, msg=f"{mbs} {n}")


def test_kl_loss_term_needs_the_reference_and_valid_settings():
    batch = _batch()
    adv = _noise(batch, 2)
    eng = _engine()
    old = eng.compute_log_probs(batch).log_probs
    with pytest.raises(ValueError, match="pass ref_log_prob"):
        eng.train_step(batch, adv, old, config=StepConfig(kl_estimator="k2"))
    with pytest.raises(ValueError, match="ref_log_prob has shape"):
        eng.train_step(batch, adv, old, ref_log_prob=old[:, :1],
                       config=StepConfig(kl_estimator="k2"))
    with pytest.raises(ValueError, match="set kl_estimator='k3'"):
        StepConfig(kl_estimator="k2", kl_is_correction="deepseek_k3")
    with pytest.raises(ValueError, match="use one of none, clipped, deepseek_k3"):
        StepConfig(kl_estimator="k2", kl_is_correction="always")
    with pytest.raises(KeyError, match="unknown KL estimator"):
        StepConfig(kl_estimator="k9")
    with pytest.raises(ValueError, match="lr_scale must be a finite number > 0"):
        eng.train_step(batch, adv, old, lr_scale=0.0)
    # no KL term asked: a given reference is ignored, and no kl metric appears
    m = eng.train_step(batch, adv, old, ref_log_prob=old)
    assert "policy/kl_loss" not in m


def test_lr_scale_reaches_the_optimizer():
    """AdamW's first update is lr·(m̂/(√v̂ + ε) + wd·θ): linear in lr, so lr_scale = 0.5 moves
    every weight exactly half as far, and train/lr reports the rate applied."""
    batch = _batch()
    adv = _noise(batch, 2) * 10
    a, b = _engine(lr=1e-2), _engine(lr=1e-2)
    old = a.compute_log_probs(batch).log_probs
    before = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    ma = a.train_step(batch, adv, old)
    mb = b.train_step(batch, adv, old, lr_scale=0.5)
    assert ma["train/lr"] == 1e-2 and mb["train/lr"] == 5e-3
    assert b._optimizer.param_groups[0]["lr"] == 5e-3
    moved = 0
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        da, db = pa.detach() - before[n], pb.detach() - before[n]
        torch.testing.assert_close(db, 0.5 * da, atol=1e-7, rtol=1e-4)
        moved += int(da.abs().max() > 0)
    assert moved > 0
