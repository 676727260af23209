"""EmbeddedTrainEngine: log-probs, entropy, routing replay, micro-batching, snapshots, updates."""

import dataclasses
import itertools
import math
import pickle

import pytest
import torch

from training.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig, agg_loss
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.model import CausalLM, ModelConfig
from training.engines.train import (
    DEFAULT_STEP_CONFIG,
    OptimConfig,
    SnapshotUnavailableError,
    StepConfig,
    TokenBatch,
    TrainEngine,
    sequence_key,
)

V = 100


def _cfg(experts=0):
    return ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=40, num_experts=experts, num_experts_per_tok=2)


def _engine(experts=0, **kw):
    kw.setdefault("optim", OptimConfig(lr=1e-3, grad_clip=None))
    return EmbeddedTrainEngine.from_config(_cfg(experts), seed=0, **kw)


def _batch(n=6, seed=1, loss_masks=False):
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(4, V, (k,), generator=g).tolist()

    prompts = [[1, *ids(1, 6)] for _ in range(n)]
    responses = [[*ids(0, 7), 2] for _ in range(n)]
    masks = None
    if loss_masks:  # drop some tokens (e.g. tool outputs) and one whole sequence
        masks = [[int((i + j) % 3 != 0) for j in range(len(r))] for i, r in enumerate(responses)]
        masks[2] = [0] * len(responses[2])
    return TokenBatch.from_sequences(prompts, responses, loss_masks=masks)


def _adv(batch, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch.batch_size, 1, generator=g).expand(-1, batch.response_len).clone()


def _manual_log_probs(model, batch, temperature=1.0):
    """One sequence at a time, unpadded: log_softmax(logits / T) gathered at the next token."""
    out = torch.zeros(batch.batch_size, batch.response_len)
    with torch.no_grad():
        for i in range(batch.batch_size):
            prompt, response = batch.sequence(i)
            ids = torch.tensor([prompt + response])
            logits, _ = model(ids)
            logp = torch.log_softmax(logits[0].float() / temperature, dim=-1)
            for j, tok in enumerate(response):
                out[i, j] = logp[len(prompt) + j - 1, tok]
    return out


def _capture_grads(engine):
    """Replace the optimizer step by a recorder of the accumulated gradients."""
    grads = {}

    def record(*_a, **_k):
        grads.clear()
        grads.update({n: p.grad.clone() for n, p in engine.model.named_parameters()
                      if p.grad is not None})

    engine._optimizer.step = record
    return grads


# ------------------------------------------------------------------------------------------------


def test_protocol_conformance():
    assert isinstance(_engine(), TrainEngine)


@pytest.mark.parametrize("experts", [0, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_manual_log_softmax_gather(experts, temperature):
    eng, batch = _engine(experts), _batch()
    res = eng.compute_log_probs(batch, temperature=temperature, micro_batch_size=4)
    expected = _manual_log_probs(eng.model, batch, temperature)
    torch.testing.assert_close(res.log_probs, expected, atol=2e-6, rtol=0)
    assert res.weight_version == 0 and res.log_probs.dtype == torch.float32
    assert (res.log_probs[~batch.valid_response_mask] == 0).all()
    if experts:
        assert res.routes is not None
        assert [tuple(r.shape) for r in res.routes] == [
            (int(n) - 1, 2, 2) for n in batch.total_lens]
    else:
        assert res.routes is None


def test_entropy_and_log_probs_hand_checked():
    """Stub logits: position s puts log 3 on token 5, 0 elsewhere (V = 100)."""
    eng = _engine()
    batch = TokenBatch.from_sequences([[1, 7]], [[5, 9]])  # response tokens at positions 2, 3

    def fixed_logits(ids, attention_mask=None, replay_routes=None):
        logits = torch.zeros(ids.shape[0], ids.shape[1], V)
        logits[..., 5] = math.log(3.0)
        return logits, None

    eng.model.forward = fixed_logits
    for temperature in (1.0, 2.0):
        # z = logits / T ; p5 = e^{z5} / (e^{z5} + 99), p_other = 1 / (e^{z5} + 99)
        e5 = 3.0 ** (1.0 / temperature)
        p5, po = e5 / (e5 + 99), 1 / (e5 + 99)
        entropy = -(p5 * math.log(p5) + 99 * po * math.log(po))
        res = eng.compute_log_probs(batch, temperature=temperature)
        torch.testing.assert_close(res.log_probs, torch.tensor([[math.log(p5), math.log(po)]]))
        torch.testing.assert_close(res.entropy, torch.tensor([[entropy, entropy]]))
    # uniform logits: H = log V, log p = −log V
    eng.model.forward = lambda ids, attention_mask=None, replay_routes=None: (
        torch.zeros(ids.shape[0], ids.shape[1], V), None)
    res = eng.compute_log_probs(batch)
    torch.testing.assert_close(res.entropy, torch.full((1, 2), math.log(V)))
    torch.testing.assert_close(res.log_probs, torch.full((1, 2), -math.log(V)))


def test_sum_pi_squared_hand_checked():
    """Σ_v π_v² of the same stub logits, returned with the entropy (the variance proxies' W)."""
    eng = _engine()
    batch = TokenBatch.from_sequences([[1, 7], [1]], [[5, 9], [5]])

    def fixed_logits(ids, attention_mask=None, replay_routes=None):
        logits = torch.zeros(ids.shape[0], ids.shape[1], V)
        logits[..., 5] = math.log(3.0)
        return logits, None

    eng.model.forward = fixed_logits
    p5, po = 3 / 102, 1 / 102
    s2 = p5 ** 2 + 99 * po ** 2
    res = eng.compute_log_probs(batch, micro_batch_size=1)
    torch.testing.assert_close(res.sum_pi_squared, torch.tensor([[s2, s2], [s2, 0.0]]))
    assert eng.compute_log_probs(batch, with_entropy=False).sum_pi_squared is None
    # per-token versions: gathered like the log-probs
    res = eng.compute_log_probs(batch, version=torch.zeros(2, 2, dtype=torch.long))
    torch.testing.assert_close(res.sum_pi_squared, torch.tensor([[s2, s2], [s2, 0.0]]))


@pytest.mark.parametrize(("loss_name", "agg", "entropy_coeff"), [
    ("vanilla", "token-mean", 0.0),
    ("vanilla", "seq-mean-token-mean", 0.0),
    ("reinforce", "seq-mean-token-sum-norm", 0.01),
    ("gspo", "seq-mean-token-mean", 0.0),
])
def test_micro_batching_gives_the_big_batch_gradient(loss_name, agg, entropy_coeff):
    batch, adv = _batch(n=7, loss_masks=True), None
    adv = _adv(batch)
    cfg = PolicyLossConfig(loss_agg_mode=agg, sequence_objective_agg_mode=agg)
    ref = _engine()
    old = ref.compute_log_probs(batch).log_probs + 0.05 * _adv(batch, seed=5)  # ratio ≠ 1

    # reference: autograd of the loss on the whole padded batch, written out by hand
    logits, _ = ref.model(batch.input_ids, attention_mask=batch.attention_mask)
    pos = (batch.prompt_lens[:, None] - 1 + torch.arange(batch.response_len)).clamp(
        max=batch.seq_len - 1)
    picked = logits.gather(1, pos[..., None].expand(-1, -1, V))
    logp = torch.log_softmax(picked, -1)
    lp = logp.gather(-1, batch.responses[..., None]).squeeze(-1)
    loss, _ = POLICY_LOSSES.get(loss_name)(old, lp, adv, batch.response_mask, cfg)
    if entropy_coeff:
        from training.algorithms.policy_loss import agg_loss
        ent = -(logp.exp() * logp).sum(-1)
        loss = loss - entropy_coeff * agg_loss(ent, batch.response_mask, agg)
    loss.backward()
    expected = {n: p.grad for n, p in ref.model.named_parameters()}

    for mbs in (None, 2, 3):
        eng = _engine()
        grads = _capture_grads(eng)
        m = eng.train_step(batch, adv, old, config=StepConfig(
            loss_name=loss_name, loss_config=cfg, micro_batch_size=mbs,
            entropy_coeff=entropy_coeff))
        torch.testing.assert_close(m["train/loss"], loss.item(), atol=1e-6, rtol=1e-6)
        for n, g in expected.items():
            torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5, msg=f"{mbs} {n}")


def test_full_batch_accumulation_is_exact_for_batch_statistic_losses():
    """kl_cov picks the top-covariance tokens of the *batch*: only full_batch matches."""
    batch = _batch(n=6)
    adv = _adv(batch)
    cfg = PolicyLossConfig(kl_cov_ratio=0.2)
    old = _engine().compute_log_probs(batch).log_probs - 0.1
    big = _engine()
    grads_big = _capture_grads(big)
    big.train_step(batch, adv, old, config=StepConfig(loss_name="kl_cov", loss_config=cfg))
    expected = dict(grads_big)
    eng = _engine()
    grads = _capture_grads(eng)
    m = eng.train_step(batch, adv, old, config=StepConfig(
        loss_name="kl_cov", loss_config=cfg, micro_batch_size=2, accumulation="full_batch"))
    for n, g in expected.items():
        torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5)
    assert m["policy/kl_cov/selected_frac"] > 0


_TIMINGS = ("train/step_time_s", "train/tokens_per_s")


def _same_step(a, b, ma, mb):
    """Bitwise-equal metrics (timings aside) and weights of two engines after a step."""
    assert {k: v for k, v in ma.items() if k not in _TIMINGS} == \
        {k: v for k, v in mb.items() if k not in _TIMINGS}
    wb = dict(b.model.named_parameters())
    assert all(torch.equal(p, wb[n]) for n, p in a.model.named_parameters())


def test_step_config_carries_each_setting_into_the_step():
    """Every field of a non-default StepConfig reaches the step as the loose keywords did: the
    step's loss, policy loss, entropy and micro-batch count are the hand-built ones for those
    values; a pickled copy (what the Megatron ranks receive) trains bit for bit the same; the
    defaults are today's and train like the same values spelt out; the config is frozen."""
    # kl_cov picks the batch's top-covariance tokens: only full_batch gives the batch's loss
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum", kl_cov_ratio=0.2)
    config = StepConfig(loss_name="kl_cov", loss_config=cfg, routing="r3", temperature=0.7,
                        micro_batch_size=3, entropy_coeff=0.01, accumulation="full_batch")
    plain = _batch(n=7, loss_masks=True)
    batch = TokenBatch(plain.input_ids, plain.attention_mask, plain.prompt_lens,
                       plain.response_lens, plain.response_mask, tuple(_random_routes(plain)))
    adv = _adv(batch)
    g = torch.Generator().manual_seed(6)
    isw = torch.rand(batch.batch_size, batch.response_len, generator=g) + 0.5
    # hand-built: the loss of those settings on the start weights' log-probs and entropy
    now = _engine(4).compute_log_probs(batch, routing="r3", temperature=0.7)
    old = now.log_probs + 0.05 * _adv(batch, seed=5)  # ratio ≠ 1
    mask = batch.response_mask
    pg, _ = POLICY_LOSSES.get("kl_cov")(old, now.log_probs, adv, mask, cfg, isw)
    loss = pg - 0.01 * agg_loss(now.entropy, mask, "seq-mean-token-sum")

    a, b = _engine(4), _engine(4)
    ma = a.train_step(batch, adv, old, rollout_is_weights=isw, config=config)
    torch.testing.assert_close(ma["train/loss"], loss.item(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ma["train/pg_loss"], pg.item(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ma["train/entropy"], now.entropy[mask].mean().item(),
                               atol=1e-6, rtol=1e-6)
    assert ma["train/micro_batches"] == 3.0 and a.weight_version == 1  # rows 3 + 3 + 1
    shipped = pickle.loads(pickle.dumps(config))
    assert shipped == config and shipped is not config
    mb = b.train_step(batch, adv, old, rollout_is_weights=isw, config=shipped)
    _same_step(a, b, ma, mb)

    spelt_out = StepConfig(loss_name="vanilla", loss_config=None, routing="free",
                           temperature=1.0, micro_batch_size=None, entropy_coeff=0.0,
                           accumulation="scaled")
    assert StepConfig() == DEFAULT_STEP_CONFIG == spelt_out
    a, b = _engine(), _engine()
    dense = _batch()
    old = a.compute_log_probs(dense).log_probs - 0.05
    _same_step(a, b, a.train_step(dense, _adv(dense), old),
               b.train_step(dense, _adv(dense), old, config=spelt_out))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.temperature = 1.0  # type: ignore[misc]


def test_step_config_refuses_bad_settings_naming_the_fix():
    with pytest.raises(KeyError, match=r"valid names: .*vanilla"):
        StepConfig(loss_name="ppo")
    with pytest.raises(ValueError, match="routing='r4'; use one of free, r2, r3"):
        StepConfig(routing="r4")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        StepConfig(temperature=0.0)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1 or None"):
        StepConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="accumulation='full'; use one of scaled, full_batch"):
        StepConfig(accumulation="full")


def test_train_step_decreases_the_loss_and_advances_versions():
    eng = _engine(optim=OptimConfig(lr=3e-3, lr_schedule="linear_warmup", warmup_steps=2))
    batch = _batch(n=8)
    adv = torch.ones(batch.batch_size, batch.response_len)  # every sampled token is good
    old = eng.compute_log_probs(batch).log_probs
    losses, lrs = [], []
    for step in range(8):
        m = eng.train_step(batch, adv, old,
                           config=StepConfig(loss_name="reinforce", micro_batch_size=3))
        losses.append(m["train/loss"])
        lrs.append(m["train/lr"])
        assert m["train/weight_version"] == step + 1 and eng.weight_version == step + 1
        assert m["train/skipped_step"] == 0.0 and m["train/grad_norm"] > 0
    assert losses[-1] < losses[0] - 0.1
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert lrs[:3] == pytest.approx([1.5e-3, 3e-3, 3e-3])
    for key in ("train/entropy", "train/tokens_per_s", "policy/pg_loss", "policy/ratio/max"):
        assert key in m


def test_non_finite_gradient_skips_the_step():
    eng = _engine()
    batch = _batch()
    adv = _adv(batch)
    adv[0, 0] = float("inf")
    before = {n: p.clone() for n, p in eng.model.named_parameters()}
    m = eng.train_step(batch, adv, eng.compute_log_probs(batch).log_probs)
    assert m["train/skipped_step"] == 1.0 and eng.weight_version == 0 and eng.step == 0
    assert all(torch.equal(p, before[n]) for n, p in eng.model.named_parameters())


# --- routing replay ------------------------------------------------------------------------------


def _random_routes(batch, num_layers=2, experts=4, k=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in batch.total_lens.tolist():
        perm = torch.stack([torch.randperm(experts, generator=g)[:k]
                            for _ in range((n - 1) * num_layers)])
        out.append(perm.reshape(n - 1, num_layers, k).to(torch.int32))
    return out


def test_r3_replays_the_given_routes_exactly():
    eng, plain = _engine(4), _batch()
    routes = _random_routes(plain)
    batch = TokenBatch.from_sequences([plain.sequence(i)[0] for i in range(plain.batch_size)],
                                      [plain.sequence(i)[1] for i in range(plain.batch_size)],
                                      routes=routes)
    res = eng.compute_log_probs(batch, routing="r3", micro_batch_size=4)
    assert res.routes is not None
    for got, want in zip(res.routes, routes, strict=True):
        assert torch.equal(got, want)
    # same log-probs as the model fed those routes directly, one sequence at a time
    for i in range(batch.batch_size):
        prompt, response = batch.sequence(i)
        ids = torch.tensor([prompt + response])
        replay = torch.zeros(1, ids.shape[1], 2, 2, dtype=torch.long)
        replay[0, :-1] = routes[i].long()
        with torch.no_grad():
            logits, used = eng.model(ids, replay_routes=replay)
        assert torch.equal(used[0, :-1].to(torch.int32), routes[i])
        logp = torch.log_softmax(logits[0], -1)
        want = torch.stack([logp[len(prompt) + j - 1, t] for j, t in enumerate(response)])
        torch.testing.assert_close(res.log_probs[i, : len(response)], want, atol=2e-6, rtol=0)
    # the free routes replayed through R3 give the free log-probs
    free = eng.compute_log_probs(plain)
    again = TokenBatch(plain.input_ids, plain.attention_mask, plain.prompt_lens,
                       plain.response_lens, plain.response_mask, free.routes)
    torch.testing.assert_close(eng.compute_log_probs(again, routing="r3").log_probs,
                               free.log_probs, atol=0, rtol=0)


def test_r2_replays_the_trainers_own_old_routes():
    eng, batch = _engine(4, optim=OptimConfig(lr=5e-2, grad_clip=None)), _batch()
    old = eng.compute_log_probs(batch)  # free at version 0: routes remembered for R2
    adv = _adv(batch)
    for _ in range(3):
        eng.train_step(batch, adv, old.log_probs, r2_version=0, config=StepConfig(routing="r2"))
    assert eng.weight_version == 3
    free_now = eng.compute_log_probs(batch)
    r2 = eng.compute_log_probs(batch, routing="r2", r2_version=0)
    for got, want in zip(r2.routes, old.routes, strict=True):
        assert torch.equal(got, want)
    flips = sum(int((a != b).sum()) for a, b in zip(free_now.routes, old.routes, strict=True))
    assert flips > 0  # the update moved the router: R2 really differs from free routing
    # R2 == R3 fed with the version-0 routes
    r3_batch = TokenBatch(batch.input_ids, batch.attention_mask, batch.prompt_lens,
                          batch.response_lens, batch.response_mask, old.routes)
    torch.testing.assert_close(eng.compute_log_probs(r3_batch, routing="r3").log_probs,
                               r2.log_probs, atol=0, rtol=0)
    # r2_version=None: the routes of the weights in use, i.e. free routing
    torch.testing.assert_close(eng.compute_log_probs(batch, routing="r2").log_probs,
                               free_now.log_probs, atol=0, rtol=0)


def test_r2_records_missing_routes_under_the_retained_snapshot():
    eng = _engine(4, optim=OptimConfig(lr=5e-2, grad_clip=None))
    seen, unseen = _batch(seed=1), _batch(seed=7)
    old = eng.compute_log_probs(seen)
    eng.train_step(seen, _adv(seen), old.log_probs, r2_version=0,
                   config=StepConfig(routing="r2"))
    # `unseen` was never forwarded at version 0: its routes are recorded under snapshot 0
    at_v0 = eng.compute_log_probs(unseen, version=0)
    eng.drop_snapshots()
    eng._routes.clear()
    with pytest.raises(SnapshotUnavailableError, match="R2 needs the routes of version 0"):
        eng.compute_log_probs(unseen, routing="r2", r2_version=0)
    eng2 = _engine(4, optim=OptimConfig(lr=5e-2, grad_clip=None))
    eng2.train_step(seen, _adv(seen), old.log_probs)
    eng2._routes.clear()
    r2 = eng2.compute_log_probs(unseen, routing="r2", r2_version=0)
    for got, want in zip(r2.routes, at_v0.routes, strict=True):
        assert torch.equal(got, want)
    assert eng2._routes.get(0, sequence_key(unseen, 0)) is not None


def test_old_version_with_r2_routes_of_another_version_uses_the_right_weights():
    """version=0 with R2 routes of version 1 whose routes are not cached: recording them loads
    snapshot 1 into the shadow model, which must not be the weights the pass then uses."""
    eng, batch = _engine(4, optim=OptimConfig(lr=5e-2, grad_clip=None)), _batch()
    old = eng.compute_log_probs(batch)
    for _ in range(2):
        eng.train_step(batch, _adv(batch), old.log_probs)
    eng._routes.clear()
    routes_v1 = eng.compute_log_probs(batch, version=1).routes
    eng._routes.clear()  # so the R2 pass records them again under snapshot 1
    got = eng.compute_log_probs(batch, version=0, routing="r2", r2_version=1)
    r3_batch = TokenBatch(batch.input_ids, batch.attention_mask, batch.prompt_lens,
                          batch.response_lens, batch.response_mask, routes_v1)
    want = eng.compute_log_probs(r3_batch, version=0, routing="r3")
    torch.testing.assert_close(got.log_probs, want.log_probs, atol=0, rtol=0)
    assert got.weight_version == 0


def test_routing_errors_name_the_fix():
    with pytest.raises(ValueError, match="dense; use routing='free'"):
        _engine().compute_log_probs(_batch(), routing="r3")
    eng = _engine(4)
    with pytest.raises(ValueError, match="return_routed_experts"):
        eng.compute_log_probs(_batch(), routing="r3")
    b = _batch()
    bad = [r[:-1] for r in _random_routes(b)]
    b = TokenBatch(b.input_ids, b.attention_mask, b.prompt_lens, b.response_lens,
                   b.response_mask, tuple(bad))
    with pytest.raises(ValueError, match=r"\(P \+ O − 1, L, k\)"):
        eng.compute_log_probs(b, routing="r3")
    with pytest.raises(ValueError, match="routing="):
        eng.compute_log_probs(b, routing="r4")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        eng.compute_log_probs(b, temperature=0.0)


# --- snapshots -----------------------------------------------------------------------------------


def test_snapshot_log_probs_equal_those_before_the_update():
    eng, batch = _engine(4, optim=OptimConfig(lr=1e-2)), _batch()
    before = eng.compute_log_probs(batch)
    adv = _adv(batch)
    eng.train_step(batch, adv, before.log_probs, config=StepConfig(micro_batch_size=4))
    mid = eng.compute_log_probs(batch)
    eng.train_step(batch, adv, before.log_probs)
    assert eng.snapshot_versions() == [0, 1]
    now = eng.compute_log_probs(batch)
    assert not torch.equal(now.log_probs, before.log_probs)
    again = eng.compute_log_probs(batch, version=0)
    assert torch.equal(again.log_probs, before.log_probs)
    assert torch.equal(again.entropy, before.entropy)
    assert again.weight_version == 0
    # per-token versions (a partial rollout that spans updates): each token under its version
    versions = torch.zeros(batch.batch_size, batch.response_len, dtype=torch.long)
    versions[:, 1::2] = 2
    versions[0] = 1
    per_token = eng.compute_log_probs(batch, version=versions)
    by_version = {0: before.log_probs, 1: mid.log_probs, 2: now.log_probs}
    want = torch.zeros_like(before.log_probs)
    for v, lp in by_version.items():
        want = torch.where(versions == v, lp, want)
    torch.testing.assert_close(per_token.log_probs, want, atol=0, rtol=0)
    assert per_token.weight_version is None and per_token.token_versions is not None


def test_snapshot_budget_evicts_oldest_with_a_clear_error():
    probe = _engine()
    size = sum(p.numel() * 4 for p in probe.model.parameters())
    eng = _engine(snapshot_budget_bytes=int(2.5 * size))
    batch = _batch()
    old = eng.compute_log_probs(batch).log_probs
    for _ in range(4):
        eng.train_step(batch, _adv(batch), old)
    assert eng.snapshot_versions() == [2, 3] and eng.weight_version == 4
    assert eng.snapshot_info()["bytes"] == 2 * size
    eng.compute_log_probs(batch, version=2)
    with pytest.raises(SnapshotUnavailableError, match=r"retained snapshots: \[2, 3\].*holds 2 "):
        eng.compute_log_probs(batch, version=1)
    with pytest.raises(ValueError, match="does not exist yet"):
        eng.compute_log_probs(batch, version=5)
    off = _engine(snapshot_budget_bytes=0)
    off.train_step(batch, _adv(batch), old)
    with pytest.raises(SnapshotUnavailableError, match="disabled"):
        off.compute_log_probs(batch, version=0)


def test_load_version_follows_another_trainer_and_counts_its_copies():
    """The dedicated old-logit model's engine: loads another trainer's versions, keeps the
    previous live weights as snapshots, and counts every parameter copy it holds."""
    trainer, batch = _engine(optim=OptimConfig(lr=1e-2)), _batch()
    size = sum(p.numel() * 4 for p in trainer.model.parameters())
    follower = _engine(snapshot_budget_bytes=size)  # the same init, one kept version
    assert follower.parameter_bytes() == size  # the live model only
    lp0 = trainer.compute_log_probs(batch).log_probs
    for _ in range(2):
        trainer.train_step(batch, _adv(batch), lp0)
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    follower.load_version(weights, 2)
    assert follower.weight_version == 2 and follower.snapshot_versions() == [0]
    assert follower.step == 0  # nothing was trained
    assert torch.equal(follower.compute_log_probs(batch).log_probs,
                       trainer.compute_log_probs(batch).log_probs)
    assert torch.equal(follower.compute_log_probs(batch, version=0).log_probs, lp0)
    assert follower.parameter_bytes() == 3 * size  # live, version 0, the shadow that ran it
    with pytest.raises(ValueError, match="not newer than the current 2"):
        follower.load_version(weights, 2)
    with pytest.raises(ValueError, match="do not match the model's parameters"):
        follower.load_version({}, 3)


def test_tied_embeddings_and_shadow_model():
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4,
                      intermediate_size=40, tie_word_embeddings=True)
    eng = EmbeddedTrainEngine(CausalLM(cfg).init_weights(0), optim=OptimConfig(lr=1e-2))
    batch = _batch()
    before = eng.compute_log_probs(batch).log_probs
    eng.train_step(batch, _adv(batch), before)
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight
    assert torch.equal(eng.compute_log_probs(batch, version=0).log_probs, before)


def test_snapshot_store_counts_a_fixed_unit_when_given():
    from training.engines.embedded.trainer import SnapshotStore

    small = {"w": torch.zeros(10)}  # 40 bytes
    own, unit = SnapshotStore(100), SnapshotStore(100, unit_bytes=60)
    for v in range(3):
        own.put(v, small)
        unit.put(v, small)
    assert own.versions() == [1, 2] and own.nbytes == 80  # two of its own 40 bytes fit
    assert unit.versions() == [2] and unit.nbytes == 60  # counted as 60 each: one fits
    with pytest.raises(SnapshotUnavailableError, match="holds 1 snapshot\\(s\\) of 60 bytes"):
        unit.get(1)
