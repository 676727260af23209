"""MegatronTrainEngine (in-process, world size 1) against the embedded engine on the same weights:
log-probs, entropy, routing replay, train steps, snapshots, export."""

import math

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e '.[megatron]')")

import torch

from training.algorithms.policy_loss import PolicyLossConfig
from training.engines.hf_io import load_hf_dir, read_meta, state_dict_for_export
from training.engines.train import SnapshotUnavailableError, StepConfig, TrainEngine

ATOL = 1e-5  # fp32, different kernels and summation orders


def _close(a, b, atol=ATOL):
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_log_probs_and_entropy_match_the_embedded_engine(mg, experts):
    emb, meg = mg.pair(experts)
    assert isinstance(meg, TrainEngine)
    batch = mg.batch()
    for kw in ({}, {"temperature": 0.7, "micro_batch_size": 4}):
        a, b = emb.compute_log_probs(batch, **kw), meg.compute_log_probs(batch, **kw)
        _close(b.log_probs, a.log_probs)
        _close(b.entropy, a.entropy)
        _close(b.sum_pi_squared, a.sum_pi_squared)  # the variance proxies' Σ_v π_v²
        assert b.weight_version == a.weight_version == 0
        if experts:  # the routers choose the same experts at every position and layer
            assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes, strict=True))
        else:
            assert b.routes is None
    # padding and response positions carry zeros, as in the embedded engine
    assert not b.log_probs[~batch.valid_response_mask].any()
    meg.close()


def test_r3_replays_the_rollout_experts(mg):
    emb, meg = mg.pair(4)
    cfg = mg.cfg(4)
    batch = mg.batch(routes_for=cfg)
    free = meg.compute_log_probs(batch)
    assert any(not torch.equal(f, r) for f, r in zip(free.routes, batch.routes, strict=True)), \
        "the test routes must differ from free routing"
    r3 = meg.compute_log_probs(batch, routing="r3")
    assert all(torch.equal(u, r) for u, r in zip(r3.routes, batch.routes, strict=True))
    _close(r3.log_probs, emb.compute_log_probs(batch, routing="r3").log_probs)
    valid = batch.valid_response_mask
    assert (r3.log_probs - free.log_probs)[valid].abs().max() > 1e-3  # the experts mattered
    with pytest.raises(ValueError, match=r"needs batch\.routes"):
        meg.compute_log_probs(mg.batch(), routing="r3")
    meg.close()


@pytest.mark.parametrize("variant", [
    {"micro_batch_size": 2},
    {"micro_batch_size": 4, "accumulation": "full_batch"},
    {"loss_name": "gspo", "micro_batch_size": 3},
    {"entropy_coeff": 0.01, "loss_config": PolicyLossConfig(loss_agg_mode="seq-mean-token-sum")},
    {"rollout_is_weights": True},
    {"experts": 4, "micro_batch_size": 2},
    {"experts": 4, "routing": "r3"},
], ids=["scaled", "full_batch", "gspo", "entropy", "is_weights", "moe", "moe_r3"])
def test_one_train_step_moves_both_engines_the_same_way(mg, variant):
    v = dict(variant)
    experts = v.pop("experts", 0)
    emb, meg = mg.pair(experts)
    batch = mg.batch(routes_for=mg.cfg(experts) if experts else None)
    adv = mg.adv(batch)
    isw = (torch.rand(batch.batch_size, batch.response_len) + 0.5
           if v.pop("rollout_is_weights", False) else None)
    config = StepConfig(**v)
    routing = config.routing
    old = emb.compute_log_probs(batch, routing=routing).log_probs
    old = old + 0.05 * mg.adv(batch, seed=9) * batch.response_mask  # ratios away from 1
    me = emb.train_step(batch, adv, old, rollout_is_weights=isw, config=config)
    mm = meg.train_step(batch, adv, old, rollout_is_weights=isw, config=config)
    assert set(mm) >= set(me)
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert math.isclose(mm[key], me[key], rel_tol=1e-5, abs_tol=1e-6), key
    for key in ("train/lr", "train/weight_version", "train/step", "train/skipped_step",
                "train/num_loss_tokens", "train/micro_batches"):
        assert mm[key] == me[key], key
    assert meg.weight_version == emb.weight_version == 1 and meg.step == 1
    _close(meg.compute_log_probs(batch, routing=routing).log_probs,
           emb.compute_log_probs(batch, routing=routing).log_probs)
    want, got = mg.params(emb), mg.params(meg)
    assert set(got) == set(want)
    # Adam divides each gradient element by its own magnitude: an element whose tiny gradient
    # differs by fp32 noise moves by a visibly different fraction of lr (1e-2); 1e-4 = 1% of it
    for name in want:
        _close(got[name], want[name], atol=1e-4)
    meg.close()


def test_snapshots_keep_old_versions_exact(mg):
    _, meg = mg.pair(4)
    batch = mg.batch()
    before = meg.compute_log_probs(batch)
    old = before.log_probs
    for _ in range(2):
        meg.train_step(batch, mg.adv(batch), old)
    assert meg.snapshot_versions() == [0, 1] and meg.weight_version == 2
    again = meg.compute_log_probs(batch, version=0)
    assert torch.equal(again.log_probs, before.log_probs) and again.weight_version == 0
    # per-token versions: the first half of each response under v0, the rest under v2
    versions = torch.where(torch.arange(batch.response_len)[None] < 2, 0, 2).expand(
        batch.batch_size, -1).clone()
    mixed = meg.compute_log_probs(batch, version=versions)
    now = meg.compute_log_probs(batch).log_probs
    assert torch.equal(mixed.log_probs, torch.where(versions == 0, before.log_probs, now)
                       * batch.valid_response_mask)
    meg.drop_snapshots([0])
    with pytest.raises(SnapshotUnavailableError, match="retained snapshots: \\[1\\]"):
        meg.compute_log_probs(batch, version=0)
    with pytest.raises(ValueError, match="does not exist yet"):
        meg.compute_log_probs(batch, version=5)
    meg.close()


def test_ewma_reference_matches_the_embedded_engines(mg):
    """old_logprob: ewma — the Megatron engine averages its own weights (ref ← β·ref + (1−β)·θ)
    where the learner averages the embedded engine's parameters: same reference log-probs, same
    reset decisions."""
    from training.algorithms.is_correction import EWMAConfig, ewma_update

    emb, meg = mg.pair(4)
    batch = mg.batch(routes_for=mg.cfg(4))
    cfg = EWMAConfig(staleness_window=2.0, reset_interval=3)  # β = 0.5
    with pytest.raises(ValueError, match="call ewma_update first"):
        meg.compute_log_probs_ewma(batch)
    state, _ = ewma_update(None, dict(emb.model.named_parameters()), cfg)
    assert meg.ewma_update(cfg) == (True, 0)
    start = meg.compute_log_probs(batch).log_probs
    _close(meg.compute_log_probs_ewma(batch).log_probs, start)  # initialised to θ
    for step in range(3):
        old = emb.compute_log_probs(batch).log_probs
        emb.train_step(batch, mg.adv(batch, seed=step), old)
        meg.train_step(batch, mg.adv(batch, seed=step), old)
        state, reset = ewma_update(state, dict(emb.model.named_parameters()), cfg)
        assert meg.ewma_update(cfg) == (reset, state.updates_since_reset)
        for routing in ("free", "r3"):
            want = emb.compute_log_probs_with_weights(batch, state.reference, routing=routing)
            got = meg.compute_log_probs_ewma(batch, routing=routing)
            _close(got.log_probs, want.log_probs, atol=1e-4)
            assert got.weight_version is None
    assert reset and state.updates_since_reset == 0  # the third update hit reset_interval=3
    live = meg.compute_log_probs(batch)  # the live model is not the shadow the EWMA used
    assert live.weight_version == 3 and not torch.equal(live.log_probs, start)
    meg.close()


def test_r2_replays_the_trainer_routes_of_the_reference_version(mg):
    emb, meg = mg.pair(4)
    batch = mg.batch()
    adv = mg.adv(batch)
    routes_v0 = meg.compute_log_probs(batch).routes  # free forward under v0: cached for R2
    emb.compute_log_probs(batch)
    old = emb.compute_log_probs(batch).log_probs
    emb.train_step(batch, adv, old)
    meg.train_step(batch, adv, old)
    r2 = meg.compute_log_probs(batch, routing="r2", r2_version=0)
    assert all(torch.equal(a, b) for a, b in zip(r2.routes, routes_v0, strict=True))
    _close(r2.log_probs, emb.compute_log_probs(batch, routing="r2", r2_version=0).log_probs)
    # a second mini-batch step replaying v0's routes
    replay = StepConfig(routing="r2")
    me = emb.train_step(batch, adv, old, r2_version=0, config=replay)
    mm = meg.train_step(batch, adv, old, r2_version=0, config=replay)
    assert math.isclose(mm["train/loss"], me["train/loss"], rel_tol=1e-5, abs_tol=1e-6)
    meg.close()


def test_non_finite_loss_skips_the_update(mg):
    _, meg = mg.pair()
    batch = mg.batch()
    old = meg.compute_log_probs(batch).log_probs
    adv = mg.adv(batch)
    adv[0, 0] = float("nan")
    m = meg.train_step(batch, adv, old)
    assert m["train/skipped_step"] == 1.0 and meg.weight_version == 0 and meg.step == 0
    assert torch.equal(meg.compute_log_probs(batch).log_probs, old)
    m = meg.train_step(batch, mg.adv(batch), old)  # the next finite step applies
    assert m["train/skipped_step"] == 0.0 and meg.weight_version == 1
    meg.close()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_writes_the_embedded_hf_format(mg, tmp_path, tie):
    _, meg = mg.pair(tie=tie)
    batch = mg.batch()
    old = meg.compute_log_probs(batch).log_probs
    meg.train_step(batch, mg.adv(batch), old)
    assert meg.export_weights(tmp_path / "v1", meta={"run": "t"}) == 1
    assert meg.export_weights(tmp_path / "v0", version=0) == 0
    assert read_meta(tmp_path / "v1")["weight_version"] == 1
    assert read_meta(tmp_path / "v1")["source"] == "asyncrl.megatron_trainer"
    loaded = load_hf_dir(tmp_path / "v1")
    assert loaded.config == mg.cfg(tie=tie)
    sd = meg.hf_state_dict()
    assert set(sd) == set(state_dict_for_export(loaded.model))
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in sd.values())
    for name, t in state_dict_for_export(loaded.model).items():
        assert torch.equal(t, sd[name]), name
    # the exported weights score tokens as the megatron engine does
    from training.engines.embedded.trainer import EmbeddedTrainEngine

    again = EmbeddedTrainEngine(loaded.model, loaded.tokenizer)
    _close(again.compute_log_probs(batch).log_probs, meg.compute_log_probs(batch).log_probs)
    _close(EmbeddedTrainEngine.from_pretrained(tmp_path / "v0").compute_log_probs(batch).log_probs,
           old)
    meg.close()
