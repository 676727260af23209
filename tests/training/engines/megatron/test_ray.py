"""MegatronTrainEngine with one Ray actor per rank: world size 1, world size 2 on CPU (gloo:
tensor parallel, data parallel, expert parallel), and a short ``asyncrl train`` run with
``engines.train: megatron`` and embedded rollout servers."""

import math

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e '.[megatron]')")

import torch

from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.hf_io import load_hf_dir, read_meta
from training.engines.megatron.engine import MegatronSettings, MegatronTrainEngine
from training.engines.train import SnapshotUnavailableError, StepConfig


def _parity_step(mg, emb, meg, batch, **kw):
    """One train step on both engines with ``StepConfig(**kw)`` (pickled to the rank actors);
    returns (embedded metrics, megatron metrics)."""
    adv = mg.adv(batch)
    old = emb.compute_log_probs(batch).log_probs
    config = StepConfig(**kw)
    me = emb.train_step(batch, adv, old, config=config)
    mm = meg.train_step(batch, adv, old, config=config)
    for key in ("train/loss", "train/entropy", "train/grad_norm"):
        assert math.isclose(mm[key], me[key], rel_tol=1e-5, abs_tol=1e-6), key
    return me, mm


@pytest.mark.slow
def test_world_size_1_on_a_rank_actor(ray_session, mg, tmp_path):
    d = mg.hf_dir(4)
    emb = EmbeddedTrainEngine.from_pretrained(d, optim=mg.OPTIM)
    meg = MegatronTrainEngine.from_pretrained(d, optim=mg.OPTIM)  # launcher="ray"
    batch = mg.batch(routes_for=mg.cfg(4))
    torch.testing.assert_close(meg.compute_log_probs(batch, routing="r3").log_probs,
                               emb.compute_log_probs(batch, routing="r3").log_probs,
                               atol=1e-5, rtol=0)
    _parity_step(mg, emb, meg, batch, micro_batch_size=2)
    assert meg.weight_version == 1
    assert meg.export_weights(tmp_path / "export") == 1
    assert read_meta(tmp_path / "export")["weight_version"] == 1
    torch.testing.assert_close(
        EmbeddedTrainEngine.from_pretrained(tmp_path / "export").compute_log_probs(batch).log_probs,
        meg.compute_log_probs(batch).log_probs, atol=1e-5, rtol=0)
    meg.close()


@pytest.mark.slow
def test_world_size_2_tensor_parallel_on_cpu(ray_session, mg, tmp_path):
    """TP=2 over two gloo ranks, odd vocabulary (padded to 102): same log-probs and step as the
    embedded engine; the merged HF weights follow; checkpoints round-trip exactly."""
    d = mg.hf_dir(0, vocab=101)
    settings = MegatronSettings(tensor_parallel=2)
    emb = EmbeddedTrainEngine.from_pretrained(d, optim=mg.OPTIM)
    meg = MegatronTrainEngine.from_pretrained(d, optim=mg.OPTIM, settings=settings)
    assert meg.world_size == 2
    batch = mg.batch(vocab=101)
    a, b = emb.compute_log_probs(batch), meg.compute_log_probs(batch)
    torch.testing.assert_close(b.log_probs, a.log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.entropy, a.entropy, atol=1e-5, rtol=0)
    _parity_step(mg, emb, meg, batch, micro_batch_size=3)
    want, got = mg.params(emb), meg.hf_state_dict()
    assert set(got) == set(want)
    for name in want:  # see test_engine: Adam turns fp32 noise into ≤ 1% of lr
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=0)
    ckpt = meg.save_checkpoint(tmp_path / "tp2")
    assert load_hf_dir(ckpt).config.vocab_size == 101
    after = meg.compute_log_probs(batch).log_probs
    meg.close()
    again = MegatronTrainEngine.from_checkpoint(ckpt, settings=settings)
    assert torch.equal(again.compute_log_probs(batch).log_probs, after)
    again.close()


@pytest.mark.slow
def test_world_size_2_data_parallel_on_cpu(ray_session, mg):
    """DP=2 with the DistributedOptimizer: micro-batches alternate between the two ranks and
    their gradients are summed, so one step equals the embedded engine's on the whole batch."""
    d = mg.hf_dir(4)
    emb = EmbeddedTrainEngine.from_pretrained(d, optim=mg.OPTIM)
    meg = MegatronTrainEngine.from_pretrained(
        d, optim=mg.OPTIM, settings=MegatronSettings(data_parallel=2, distributed_optimizer=True))
    batch = mg.batch(n=8)
    me, mm = _parity_step(mg, emb, meg, batch, micro_batch_size=3)
    assert mm["train/micro_batches"] == 3
    for key, value in me.items():
        if key.startswith("policy/") and not key.endswith(("/max", "/min", "/p50", "/p90",
                                                           "/p99")):
            assert math.isclose(mm[key], value, rel_tol=1e-4, abs_tol=1e-6), key
    for mbs in (None, 3):  # one micro-batch on both ranks; three shared out (2 + 1)
        torch.testing.assert_close(meg.compute_log_probs(batch, micro_batch_size=mbs).log_probs,
                                   emb.compute_log_probs(batch).log_probs, atol=1e-5, rtol=0)
    meg.close()


@pytest.mark.slow
def test_world_size_2_expert_parallel_on_cpu(ray_session, mg, tmp_path):
    """EP=2 over DP=2 (4 experts, 2 per rank): the MoE token all-gather pairs the ranks' forwards,
    so micro-batches run in padded rounds (3 micro-batches: the second round's dummy on rank 1).
    Log-probs (free and R3, one and several micro-batches), one step and the merged HF weights
    match the embedded engine; a checkpoint resumes exactly."""
    d = mg.hf_dir(4)
    settings = MegatronSettings(expert_parallel=2, data_parallel=2)
    emb = EmbeddedTrainEngine.from_pretrained(d, optim=mg.OPTIM)
    meg = MegatronTrainEngine.from_pretrained(d, optim=mg.OPTIM, settings=settings)
    batch = mg.batch(n=8, routes_for=mg.cfg(4))
    for kw in ({}, {"micro_batch_size": 3}, {"routing": "r3", "micro_batch_size": 3}):
        a, b = emb.compute_log_probs(batch, **kw), meg.compute_log_probs(batch, **kw)
        torch.testing.assert_close(b.log_probs, a.log_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.entropy, a.entropy, atol=1e-5, rtol=0)
        assert [tuple(r.shape) for r in b.routes] == [tuple(r.shape) for r in a.routes]
        if kw.get("routing") != "r3":  # free routing: both engines choose the same experts
            assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes, strict=True))
    _, mm = _parity_step(mg, emb, meg, batch, micro_batch_size=3, routing="r3")
    assert mm["train/micro_batches"] == 3
    want, got = mg.params(emb), meg.hf_state_dict()
    assert set(got) == set(want)
    for name in want:  # every expert, from both EP ranks
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=0)
    ckpt = meg.save_checkpoint(tmp_path / "ep2")
    after = meg.compute_log_probs(batch, micro_batch_size=3).log_probs
    meg.close()
    again = MegatronTrainEngine.from_checkpoint(ckpt, settings=settings)
    assert torch.equal(again.compute_log_probs(batch, micro_batch_size=3).log_probs, after)
    again.close()


@pytest.mark.slow
@pytest.mark.parametrize(("experts", "tie"), [
    pytest.param(0, True, id="dense-tied"), pytest.param(4, False, id="moe")])
def test_world_size_2_pipeline_parallel_on_cpu(ray_session, mg, tmp_path, experts, tie):
    """PP=2 (one layer per stage): stage 0 holds the embedding, stage 1 the final norm and the
    output layer (with tied embeddings its own copy, kept equal through summed gradients).
    Log-probs, recorded routes, R3 replay, a step in both accumulation modes and the merged HF
    weights match the embedded engine; a checkpoint resumes exactly."""
    from training.engines.hf_io import read_state_dict
    from training.engines.megatron.convert import hf_to_megatron, to_stage

    d = mg.hf_dir(experts, tie=tie)
    settings = MegatronSettings(pipeline_parallel=2)
    # the stages hold shards of different sizes; a budget of two of the smaller would keep two
    # versions on one stage and one on the other if each counted its own size
    full = hf_to_megatron(read_state_dict(d), mg.cfg(experts, tie=tie), layout="local")
    sizes = sorted(sum(t.numel() * 4 for t in to_stage(full, mg.cfg(experts, tie=tie), pp=2,
                                                        pp_rank=r).values()) for r in range(2))
    assert sizes[0] < sizes[1]
    emb = EmbeddedTrainEngine.from_pretrained(d, optim=mg.OPTIM)
    meg = MegatronTrainEngine.from_pretrained(d, optim=mg.OPTIM, settings=settings,
                                              snapshot_budget_bytes=2 * sizes[0])
    assert meg.world_size == 2
    batch = mg.batch(n=7, routes_for=mg.cfg(experts) if experts else None)
    kws = [{}, {"micro_batch_size": 3}] + ([{"routing": "r3"}] if experts else [])
    for kw in kws:
        a, b = emb.compute_log_probs(batch, **kw), meg.compute_log_probs(batch, **kw)
        torch.testing.assert_close(b.log_probs, a.log_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.entropy, a.entropy, atol=1e-5, rtol=0)
        if experts and not kw.get("routing"):  # both stages' layers, the same experts
            assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes, strict=True))
    step = {"routing": "r3"} if experts else {}
    _parity_step(mg, emb, meg, batch, micro_batch_size=3, **step)
    emb_v1 = emb.compute_log_probs(batch).log_probs
    _parity_step(mg, emb, meg, batch, micro_batch_size=4, accumulation="full_batch", **step)
    assert meg.snapshot_versions() == [1]  # both stages count the larger shard: one fits
    torch.testing.assert_close(meg.compute_log_probs(batch, version=1).log_probs, emb_v1,
                               atol=1e-4, rtol=0)
    with pytest.raises(SnapshotUnavailableError):  # raised on every stage, none left waiting
        meg.compute_log_probs(batch, version=0)
    want, got = mg.params(emb), meg.hf_state_dict()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=0)
    ckpt = meg.save_checkpoint(tmp_path / "pp2")
    after = meg.compute_log_probs(batch).log_probs
    meg.close()
    again = MegatronTrainEngine.from_checkpoint(ckpt, settings=settings)
    assert torch.equal(again.compute_log_probs(batch).log_probs, after)
    again.close()


@pytest.mark.slow
def test_asyncrl_train_runs_with_the_megatron_backend(ray_session, tmp_path):
    from training.recipe import recipe_from_dict
    from training.runtime.run import run_recipe
    from training.runtime.sinks import read_metrics

    recipe = recipe_from_dict({
        "name": "test-megatron", "steps": 2,
        "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32,
                  "num_layers": 2},
        "engines": {"train": "megatron", "num_rollout_engines": 2},
        "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 24},
        "async": {"mode": "sync"},
        "eval": {"every": 0, "n": 0},
    })
    res = run_recipe(recipe, out=tmp_path / "run")
    assert res.steps_done == 2 and not res.interrupted
    rows = [r for r in read_metrics(res.run_dir / "metrics.jsonl")
            if not r.get("step/eval_only")]
    assert [r["step"] for r in rows] == [0, 1]  # each step exactly once
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert rows[-1]["step/weight_version"] == 2
    assert read_meta(res.final_hf)["weight_version"] == 2
    assert read_meta(res.final_hf)["source"] == "asyncrl.megatron_trainer"
    assert (res.trainer_checkpoint / "megatron" / "metadata.json").is_file()
