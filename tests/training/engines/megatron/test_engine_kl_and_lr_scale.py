"""MegatronTrainEngine against the embedded engine with the KL-to-reference loss term and a
per-step learning-rate factor: the same loss, KL term, applied LR and weights."""

import math

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e '.[megatron]')")

import torch

from training.engines.train import StepConfig


def test_kl_loss_term_and_lr_scale_move_both_engines_the_same_way(mg):
    emb, meg = mg.pair(0)
    batch = mg.batch()
    adv = mg.adv(batch)
    config = StepConfig(micro_batch_size=2, kl_estimator="k3", kl_coef=0.5,
                        kl_is_correction="deepseek_k3")
    now = emb.compute_log_probs(batch).log_probs
    old = now + 0.05 * mg.adv(batch, seed=9) * batch.response_mask  # ρ ≠ 1
    ref = now - 0.05 * mg.adv(batch, seed=10) * batch.response_mask  # π_θ ≠ π_ref
    me = emb.train_step(batch, adv, old, ref_log_prob=ref, lr_scale=0.5, config=config)
    mm = meg.train_step(batch, adv, old, ref_log_prob=ref, lr_scale=0.5, config=config)
    assert me["policy/kl_loss"] > 0
    for key in ("train/loss", "train/pg_loss", "policy/kl_loss", "train/grad_norm"):
        assert math.isclose(mm[key], me[key], rel_tol=1e-5, abs_tol=1e-6), key
    assert mm["train/lr"] == me["train/lr"] == 0.5 * emb.optim.lr
    want, got = mg.params(emb), mg.params(meg)
    for name in want:  # Adam: 1 % of the lr, as in test_engine.py
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=0)
    meg.close()
