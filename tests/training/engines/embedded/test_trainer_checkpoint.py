"""EmbeddedTrainEngine: weight export, exact resume, and the resume guard (seed 000, stage 1)."""

import json
import random

import numpy as np
import pytest
import torch

from training.engines.embedded.trainer import TRAINER_STATE_FILE, EmbeddedTrainEngine
from training.engines.hf_io import CheckpointError, load_hf_dir, read_meta
from training.engines.model import ModelConfig
from training.engines.train import OptimConfig, StepConfig, TokenBatch

V = 100


def _cfg(experts=0):
    return ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=40, num_experts=experts, num_experts_per_tok=2)


OPTIM = OptimConfig(lr=2e-2, lr_schedule="cosine", warmup_steps=1, total_steps=6,
                    min_lr_ratio=0.1, grad_clip=0.5)


def _engine(experts=0, **kw):
    kw.setdefault("optim", OPTIM)
    return EmbeddedTrainEngine.from_config(_cfg(experts), seed=0, **kw)


def _batch(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(4, V, (k,), generator=g).tolist()

    return TokenBatch.from_sequences([[1, *ids(1, 6)] for _ in range(n)],
                                     [[*ids(0, 7), 2] for _ in range(n)])


def _adv(batch, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch.batch_size, 1, generator=g).expand(-1, batch.response_len).clone()


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


# --- export --------------------------------------------------------------------------------------


@pytest.mark.parametrize("experts", [0, 4])
def test_export_loads_back_identically(tmp_path, experts):
    eng, batch = _engine(experts), _batch()
    old = eng.compute_log_probs(batch)
    eng.train_step(batch, _adv(batch), old.log_probs)
    version = eng.export_weights(tmp_path / "v1")
    assert version == 1 == read_meta(tmp_path / "v1")["weight_version"]
    loaded = load_hf_dir(tmp_path / "v1")
    assert loaded.weight_version == 1
    for n, p in eng.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[n], p), n
    back = EmbeddedTrainEngine.from_pretrained(tmp_path / "v1")
    assert back.weight_version == 1
    assert torch.equal(back.compute_log_probs(batch).log_probs,
                       eng.compute_log_probs(batch).log_probs)
    # a retained old version exports too, and reproduces the old log-probs
    assert eng.export_weights(tmp_path / "v0", version=0) == 0
    v0 = EmbeddedTrainEngine.from_pretrained(tmp_path / "v0")
    assert v0.weight_version == 0
    assert torch.equal(v0.compute_log_probs(batch).log_probs, old.log_probs)


def test_transformers_loads_a_dense_export_with_the_same_log_probs(tmp_path):
    transformers = pytest.importorskip("transformers")
    eng, batch = _engine(), _batch()
    eng.train_step(batch, _adv(batch), eng.compute_log_probs(batch).log_probs)
    eng.export_weights(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ours = eng.compute_log_probs(batch, temperature=0.8).log_probs
    with torch.no_grad():
        for i in range(batch.batch_size):
            prompt, response = batch.sequence(i)
            logits = hf(input_ids=torch.tensor([prompt + response])).logits[0]
            logp = torch.log_softmax(logits.float() / 0.8, -1)
            want = torch.stack([logp[len(prompt) + j - 1, t] for j, t in enumerate(response)])
            torch.testing.assert_close(ours[i, : len(response)], want, atol=1e-5, rtol=0)


# --- exact resume --------------------------------------------------------------------------------


@pytest.mark.parametrize("experts", [0, 4])
def test_resume_is_exact(tmp_path, experts):
    """The next steps after resuming equal an uninterrupted run's, bitwise (fp32, CPU)."""
    batches = [_batch(seed=s) for s in (1, 2, 3, 4)]
    routing = "r2" if experts else "free"

    def run_step(engine, i, r2_version):
        b = batches[i]
        old = engine.compute_log_probs(b, version=r2_version)
        return engine.train_step(b, _adv(b, seed=i), old.log_probs, r2_version=r2_version,
                                 config=StepConfig(micro_batch_size=4, routing=routing))

    a = _engine(experts)
    for i in range(2):
        run_step(a, i, 0)
    a.save_checkpoint(tmp_path / "ckpt")
    expected_draws = (torch.rand(3), np.random.rand(2), random.random())
    tail_a = [run_step(a, i, 1) for i in (2, 3)]

    torch.manual_seed(1234)  # whatever happened in between, the checkpoint's RNG state returns
    np.random.seed(5)
    random.seed(6)
    b = EmbeddedTrainEngine.from_checkpoint(tmp_path / "ckpt")
    draws = (torch.rand(3), np.random.rand(2), random.random())
    assert (b.step, b.weight_version, b.optim) == (2, 2, OPTIM)
    assert b.snapshot_versions() == [0, 1]
    tail_b = [run_step(b, i, 1) for i in (2, 3)]
    for ma, mb in zip(tail_a, tail_b, strict=True):
        for key in ("train/loss", "train/grad_norm", "train/lr", "policy/ppo_kl"):
            assert ma[key] == mb[key], key
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert torch.equal(draws[0], expected_draws[0])
    assert np.array_equal(draws[1], expected_draws[1]) and draws[2] == expected_draws[2]


def test_checkpoint_layout_is_an_hf_dir(tmp_path):
    eng, batch = _engine(), _batch()
    eng.train_step(batch, _adv(batch), eng.compute_log_probs(batch).log_probs)
    eng.save_checkpoint(tmp_path / "ck")
    eng.save_checkpoint(tmp_path / "ck")  # overwrite in place, atomically
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", TRAINER_STATE_FILE,
            "snapshots"} <= set(names)
    assert json.loads((tmp_path / "ck" / "asyncrl.json").read_text())["weight_version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporaries left
    small = _engine()
    small.train_step(batch, _adv(batch), eng.compute_log_probs(batch).log_probs)
    small.save_checkpoint(tmp_path / "nosnap", include_snapshots=False)
    assert not (tmp_path / "nosnap" / "snapshots").exists()
    assert EmbeddedTrainEngine.from_checkpoint(tmp_path / "nosnap").snapshot_versions() == []


# --- resume guard --------------------------------------------------------------------------------


def test_resume_guard_refuses_missing_empty_and_unreadable_paths(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        EmbeddedTrainEngine.from_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty; refusing to start from random weights"):
        EmbeddedTrainEngine.from_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="does not exist"):
        EmbeddedTrainEngine.from_pretrained(tmp_path / "missing")

    eng, batch = _engine(), _batch()
    eng.train_step(batch, _adv(batch), eng.compute_log_probs(batch).log_probs)
    eng.export_weights(tmp_path / "export")
    with pytest.raises(CheckpointError, match="not a trainer checkpoint"):
        EmbeddedTrainEngine.from_checkpoint(tmp_path / "export")

    eng.save_checkpoint(tmp_path / "bad_state")
    (tmp_path / "bad_state" / TRAINER_STATE_FILE).write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"unreadable.*corrupt"):
        EmbeddedTrainEngine.from_checkpoint(tmp_path / "bad_state")

    eng.save_checkpoint(tmp_path / "bad_weights")
    (tmp_path / "bad_weights" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable"):
        EmbeddedTrainEngine.from_checkpoint(tmp_path / "bad_weights")

    eng.save_checkpoint(tmp_path / "bad_snapshot")
    next((tmp_path / "bad_snapshot" / "snapshots").iterdir()).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="snapshot"):
        EmbeddedTrainEngine.from_checkpoint(tmp_path / "bad_snapshot")

    eng.save_checkpoint(tmp_path / "good")
    other = EmbeddedTrainEngine.from_config(_cfg(experts=4))
    with pytest.raises(CheckpointError, match="different architecture"):
        other.load_checkpoint(tmp_path / "good")


def test_failed_load_leaves_the_engine_unchanged(tmp_path):
    eng, batch = _engine(), _batch()
    eng.train_step(batch, _adv(batch), eng.compute_log_probs(batch).log_probs)
    eng.save_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / TRAINER_STATE_FILE).write_bytes(b"truncated")
    fresh = _engine()
    before = _params(fresh)
    for path in (tmp_path / "ck", tmp_path / "nope"):
        with pytest.raises(CheckpointError):
            fresh.load_checkpoint(path)
    assert fresh.weight_version == 0 and fresh.step == 0
    after = _params(fresh)
    assert all(torch.equal(before[n], after[n]) for n in before)
