"""``engines.megatron.precision: bf16``: bf16 weights and activations (megatron's Float16Module)
with fp32 master weights and optimizer state, against the fp32 embedded engine on the same
weights; fp32 HF exports of the bf16 values; exact checkpoint resume (master weights included);
a checkpoint of one precision refused by an engine of the other."""

import math

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e '.[megatron]')")

import torch

from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.hf_io import CheckpointError, load_hf_dir, state_dict_for_export
from training.engines.megatron.engine import MegatronSettings, MegatronTrainEngine
from training.engines.train import StepConfig

# |log-prob(bf16 megatron) − log-prob(fp32 embedded)| on these tiny models: max 1.0e-3–2.1e-3
# (dense and MoE, 5 batches, T = 1 and 0.7), 5.3e-3 where bf16 flips one token's expert choice
# (free routing); fp32 megatron agrees to ≤ 1e-6 (test_engine). 1e-2 leaves ≥ 2× margin over
# the worst and ~5× over the batches below.
BF16_ATOL = 1e-2
BF16 = MegatronSettings(precision="bf16")
MICRO_BATCHES_OF_3 = StepConfig(micro_batch_size=3)


def _bf16(mg, experts=0, settings=BF16, **hf):
    return MegatronTrainEngine.from_pretrained(mg.hf_dir(experts, **hf), optim=mg.OPTIM,
                                               launcher="local", settings=settings)


def _bf16_valued(t):
    """Whether every element of fp32 ``t`` is a bf16 number."""
    return t.dtype == torch.float32 and torch.equal(t.to(torch.bfloat16).float(), t)


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_bf16_log_probs_are_within_bf16_rounding_of_fp32(mg, experts):
    emb = EmbeddedTrainEngine.from_pretrained(mg.hf_dir(experts), optim=mg.OPTIM)
    meg = _bf16(mg, experts)
    batch = mg.batch(routes_for=mg.cfg(experts) if experts else None)
    valid = batch.valid_response_mask
    variants = [{}, {"temperature": 0.7, "micro_batch_size": 4}]
    if experts:
        variants.append({"routing": "r3"})
    for kw in variants:
        a, b = emb.compute_log_probs(batch, **kw), meg.compute_log_probs(batch, **kw)
        assert b.log_probs.dtype == torch.float32 and b.entropy.dtype == torch.float32
        diff = (b.log_probs - a.log_probs)[valid].abs().max().item()
        # bf16 is really on (fp32 agrees to 1e-6), and only rounding apart
        assert 1e-5 < diff < BF16_ATOL, (kw, diff)
        torch.testing.assert_close(b.entropy, a.entropy, atol=BF16_ATOL, rtol=0)
        assert not b.log_probs[~valid].any()
        if kw.get("routing") == "r3":
            assert all(torch.equal(u, r) for u, r in zip(b.routes, batch.routes, strict=True))
    meg.close()


def test_bf16_train_step_moves_the_loss_and_the_weights_like_fp32(mg):
    emb = EmbeddedTrainEngine.from_pretrained(mg.hf_dir(), optim=mg.OPTIM)
    meg = _bf16(mg)
    batch = mg.batch()
    adv = mg.adv(batch)
    old = emb.compute_log_probs(batch).log_probs
    start = meg.compute_log_probs(batch).log_probs
    before_emb, before = mg.params(emb), meg.hf_state_dict()
    losses = []
    for _ in range(3):
        me = emb.train_step(batch, adv, old, config=MICRO_BATCHES_OF_3)
        mm = meg.train_step(batch, adv, old, config=MICRO_BATCHES_OF_3)
        assert mm["train/skipped_step"] == 0.0
        for key in ("train/loss", "train/entropy"):
            assert math.isclose(mm[key], me[key], abs_tol=BF16_ATOL), (key, mm[key], me[key])
        assert math.isclose(mm["train/grad_norm"], me["train/grad_norm"], rel_tol=0.05)
        losses.append(mm["train/loss"])
    assert losses[2] < losses[1] < losses[0]  # the same batch: the objective improves
    assert (meg.weight_version, meg.step) == (3, 3)
    after_emb, after = mg.params(emb), meg.hf_state_dict()
    for name in before:
        step_meg, step_emb = after[name] - before[name], after_emb[name] - before_emb[name]
        assert step_meg.abs().max() > 0, name
        # the same update as fp32, up to bf16 rounding of the weights
        cos = torch.nn.functional.cosine_similarity(step_meg.flatten(), step_emb.flatten(), dim=0)
        assert cos > 0.9, (name, float(cos))
    # the snapshot of v0 (bf16 weights in an unwrapped shadow model) scores as v0 did
    assert torch.equal(meg.compute_log_probs(batch, version=0).log_probs, start)
    meg.close()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_bf16_exports_fp32_hf_weights(mg, tmp_path, tie):
    meg = _bf16(mg, tie=tie)
    batch = mg.batch()
    meg.train_step(batch, mg.adv(batch), meg.compute_log_probs(batch).log_probs)
    sd = meg.hf_state_dict()
    assert all(t.device.type == "cpu" and _bf16_valued(t) for t in sd.values())
    assert meg.export_weights(tmp_path / "v1") == 1
    loaded = load_hf_dir(tmp_path / "v1")
    exported = state_dict_for_export(loaded.model)
    assert set(exported) == set(sd)
    assert all(torch.equal(exported[n], sd[n]) for n in sd)  # fp32 on disk, the bf16 values
    # the fp32 embedded engine on the exported weights scores within bf16 rounding
    again = EmbeddedTrainEngine(loaded.model, loaded.tokenizer)
    torch.testing.assert_close(again.compute_log_probs(batch).log_probs,
                               meg.compute_log_probs(batch).log_probs, atol=BF16_ATOL, rtol=0)
    meg.close()


@pytest.mark.parametrize(("experts", "distributed_optimizer"), [(0, False), (4, True)],
                         ids=["dense", "moe-distributed-optimizer"])
def test_bf16_checkpoint_round_trip_is_exact(mg, tmp_path, experts, distributed_optimizer):
    settings = MegatronSettings(precision="bf16", distributed_optimizer=distributed_optimizer)
    meg = _bf16(mg, experts, settings)
    batch = mg.batch()
    old = meg.compute_log_probs(batch).log_probs
    for _ in range(2):
        meg.train_step(batch, mg.adv(batch), old, config=MICRO_BATCHES_OF_3)
    path = meg.save_checkpoint(tmp_path / "ckpt")
    fresh = MegatronTrainEngine.from_checkpoint(path, launcher="local", settings=settings)
    assert (fresh.weight_version, fresh.step) == (2, 2)
    a, b = meg.compute_log_probs(batch), fresh.compute_log_probs(batch)
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.entropy, b.entropy)
    assert torch.equal(meg.compute_log_probs(batch, version=0).log_probs,
                       fresh.compute_log_probs(batch, version=0).log_probs)
    # several more steps stay bitwise equal: the fp32 master weights and Adam moments came back
    # (master weights rounded to bf16 on load would diverge within a step or two)
    for seed in (4, 5, 6):
        ma = meg.train_step(batch, mg.adv(batch, seed=seed), old, config=MICRO_BATCHES_OF_3)
        mb = fresh.train_step(batch, mg.adv(batch, seed=seed), old, config=MICRO_BATCHES_OF_3)
        for key in ("train/loss", "train/grad_norm", "train/lr", "train/weight_version"):
            assert ma[key] == mb[key], key
        pa, pb = meg.hf_state_dict(), fresh.hf_state_dict()
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # load_checkpoint into a live engine rewinds it exactly, and it steps on as `fresh` did
    meg.load_checkpoint(path)
    assert meg.weight_version == 2 and torch.equal(meg.compute_log_probs(batch).log_probs,
                                                   a.log_probs)
    ma = meg.train_step(batch, mg.adv(batch, seed=4), old, config=MICRO_BATCHES_OF_3)
    fresh.load_checkpoint(path)
    mb = fresh.train_step(batch, mg.adv(batch, seed=4), old, config=MICRO_BATCHES_OF_3)
    assert ma["train/loss"] == mb["train/loss"] and ma["train/grad_norm"] == mb["train/grad_norm"]
    meg.close()
    fresh.close()


def test_a_checkpoint_of_another_precision_is_refused(mg, tmp_path):
    meg = _bf16(mg)
    batch = mg.batch()
    meg.train_step(batch, mg.adv(batch), meg.compute_log_probs(batch).log_probs)
    bf16_ckpt = meg.save_checkpoint(tmp_path / "bf16")
    with pytest.raises(CheckpointError, match="trained in bf16, this engine runs fp32") as err:
        MegatronTrainEngine.from_checkpoint(bf16_ckpt, launcher="local")
    assert "\n" not in str(err.value) and "precision: bf16" in str(err.value)
    # a live fp32 engine refuses it and is unchanged; the reverse is refused too
    fp32 = MegatronTrainEngine.from_pretrained(mg.hf_dir(), optim=mg.OPTIM, launcher="local")
    before = fp32.compute_log_probs(batch).log_probs
    with pytest.raises(CheckpointError, match="trained in bf16, this engine runs fp32"):
        fp32.load_checkpoint(bf16_ckpt)
    assert fp32.weight_version == 0
    assert torch.equal(fp32.compute_log_probs(batch).log_probs, before)
    fp32_ckpt = fp32.save_checkpoint(tmp_path / "fp32")
    with pytest.raises(CheckpointError, match="trained in fp32, this engine runs bf16") as err:
        meg.load_checkpoint(fp32_ckpt)
    assert "\n" not in str(err.value)
    assert meg.weight_version == 1
    # its HF weights warm start either precision (the directory is also an HF model directory)
    warm = MegatronTrainEngine.from_pretrained(bf16_ckpt, launcher="local")
    assert warm.weight_version == 1
    warm.close()
    fp32.close()
    meg.close()


def test_precision_is_validated():
    with pytest.raises(ValueError, match="precision='fp16'; use one of fp32, bf16"):
        MegatronSettings(precision="fp16")
    assert MegatronSettings().precision == "fp32"


@pytest.mark.slow
def test_bf16_pipeline_parallel_on_two_ray_ranks(mg):
    """PP=2 (tied embeddings): the stages pass bf16 hidden states and their gradients."""
    import os

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    started = not ray.is_initialized()
    if started:  # two CPUs = two rank bundles (as test_ray.py)
        from training.ray_setup import init_ray

        init_ray(num_cpus=2)  # loopback-only, reaped with this process
    try:
        d = mg.hf_dir(tie=True)
        emb = EmbeddedTrainEngine.from_pretrained(d, optim=mg.OPTIM)
        meg = MegatronTrainEngine.from_pretrained(
            d, optim=mg.OPTIM, settings=MegatronSettings(pipeline_parallel=2, precision="bf16"))
        batch = mg.batch()
        a, b = emb.compute_log_probs(batch), meg.compute_log_probs(batch)
        diff = (b.log_probs - a.log_probs)[batch.valid_response_mask].abs().max().item()
        assert 1e-5 < diff < BF16_ATOL, diff
        before = meg.hf_state_dict()
        me = emb.train_step(batch, mg.adv(batch), a.log_probs, config=MICRO_BATCHES_OF_3)
        mm = meg.train_step(batch, mg.adv(batch), a.log_probs, config=MICRO_BATCHES_OF_3)
        assert math.isclose(mm["train/loss"], me["train/loss"], abs_tol=BF16_ATOL)
        assert math.isclose(mm["train/grad_norm"], me["train/grad_norm"], rel_tol=0.05)
        after = meg.hf_state_dict()
        assert all(_bf16_valued(after[n]) and not torch.equal(after[n], before[n])
                   for n in before)
        meg.close()
    finally:
        if started:
            ray.shutdown()
