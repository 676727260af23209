"""MegatronTrainEngine checkpoints: exact resume through dist_checkpointing, and the resume guard
(a missing / empty / unreadable / foreign directory never yields random weights)."""

import json
import shutil

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e '.[megatron]')")

import torch

from training.engines.hf_io import CheckpointError, load_hf_dir, read_meta
from training.engines.megatron.engine import MegatronSettings, MegatronTrainEngine
from training.engines.megatron.rank import TRAINER_STATE_FILE
from training.engines.train import StepConfig

MICRO_BATCHES_OF_3 = StepConfig(micro_batch_size=3)


def _trained(mg, experts=4, steps=2):
    _, meg = mg.pair(experts)
    batch = mg.batch()
    old = meg.compute_log_probs(batch).log_probs
    for _ in range(steps):
        meg.train_step(batch, mg.adv(batch), old, config=MICRO_BATCHES_OF_3)
    return meg, batch, old


def test_round_trip_is_exact(mg, tmp_path):
    meg, batch, old = _trained(mg)
    path = meg.save_checkpoint(tmp_path / "ckpt")
    assert (path / "megatron" / "metadata.json").is_file() and (path / TRAINER_STATE_FILE).is_file()
    assert load_hf_dir(path).config == mg.cfg(4)  # also a plain HF model directory
    assert read_meta(path)["weight_version"] == 2
    fresh = MegatronTrainEngine.from_checkpoint(path, launcher="local")
    assert (fresh.weight_version, fresh.step) == (2, 2)
    assert fresh.snapshot_versions() == meg.snapshot_versions() == [0, 1]
    a, b = meg.compute_log_probs(batch), fresh.compute_log_probs(batch)
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.entropy, b.entropy)
    assert torch.equal(meg.compute_log_probs(batch, version=0).log_probs,
                       fresh.compute_log_probs(batch, version=0).log_probs)
    # the next step (optimizer moments, schedule position) is bitwise the same
    ma = meg.train_step(batch, mg.adv(batch, seed=4), old, config=MICRO_BATCHES_OF_3)
    mb = fresh.train_step(batch, mg.adv(batch, seed=4), old, config=MICRO_BATCHES_OF_3)
    for key in ("train/loss", "train/grad_norm", "train/lr", "train/weight_version"):
        assert ma[key] == mb[key], key
    pa, pb = meg.hf_state_dict(), fresh.hf_state_dict()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # load_checkpoint into a live engine rewinds it exactly
    meg.load_checkpoint(path)
    assert meg.weight_version == 2
    assert torch.equal(meg.compute_log_probs(batch).log_probs, a.log_probs)
    meg.close()
    fresh.close()


def test_checkpoint_before_any_step(mg, tmp_path):
    _, meg = mg.pair()
    batch = mg.batch()
    meg.save_checkpoint(tmp_path / "c0")
    fresh = MegatronTrainEngine.from_checkpoint(tmp_path / "c0", launcher="local")
    old = meg.compute_log_probs(batch).log_probs
    assert torch.equal(fresh.compute_log_probs(batch).log_probs, old)
    ma = meg.train_step(batch, mg.adv(batch), old)
    mb = fresh.train_step(batch, mg.adv(batch), old)
    assert ma["train/loss"] == mb["train/loss"] and ma["train/grad_norm"] == mb["train/grad_norm"]
    meg.close()
    fresh.close()


def _corrupt(kind, src, dst):
    shutil.copytree(src, dst)
    if kind == "no_trainer_state":
        (dst / TRAINER_STATE_FILE).unlink()
    elif kind == "garbage_trainer_state":
        (dst / TRAINER_STATE_FILE).write_bytes(b"not a torch file")
    elif kind == "no_megatron_dir":
        shutil.rmtree(dst / "megatron")
    elif kind == "truncated_shards":
        for f in (dst / "megatron").glob("*.distcp"):
            f.write_bytes(f.read_bytes()[:100])
    elif kind == "other_layout":
        state = torch.load(dst / TRAINER_STATE_FILE, weights_only=True)
        state["parallel"] = {**state["parallel"], "tensor_parallel": 2}
        torch.save(state, dst / TRAINER_STATE_FILE)
    elif kind == "other_layer_spec":  # written where TransformerEngine ran
        state = torch.load(dst / TRAINER_STATE_FILE, weights_only=True)
        assert state["layout"] == "local"
        torch.save({**state, "layout": "te"}, dst / TRAINER_STATE_FILE)
    elif kind == "other_architecture":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["num_hidden_layers"] = 3
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(("kind", "message"), [
    ("no_trainer_state", "not a megatron trainer checkpoint"),
    ("garbage_trainer_state", "is unreadable"),
    ("no_megatron_dir", "no dist_checkpointing metadata"),
    ("truncated_shards", "corrupt or incomplete"),
    ("other_layout", "resume with the same engines.megatron sizes"),
    ("other_layer_spec", "holds megatron weights of the 'te' layer spec, this machine builds "
                         "the 'local' one"),
    ("other_architecture", "different architecture"),
])
def test_load_refuses_a_bad_checkpoint_and_leaves_the_engine_unchanged(mg, tmp_path, kind,
                                                                       message):
    meg, batch, _ = _trained(mg, experts=0, steps=1)
    good = meg.save_checkpoint(tmp_path / "good")
    before = meg.compute_log_probs(batch).log_probs
    meg.train_step(batch, mg.adv(batch), before)  # move away from the checkpoint
    moved = meg.compute_log_probs(batch).log_probs
    bad = _corrupt(kind, good, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=message) as err:
        meg.load_checkpoint(bad)
    assert "\n" not in str(err.value)
    assert meg.weight_version == 2
    assert torch.equal(meg.compute_log_probs(batch).log_probs, moved)
    meg.train_step(batch, mg.adv(batch), before)  # still trains
    meg.close()


def test_from_checkpoint_builds_the_layer_spec_it_was_written_with(mg, tmp_path):
    """A checkpoint from before the TE spec existed (no ``layout``) resumes as the local spec; one
    written with TE's spec is refused with one line where TE and a GPU are missing."""
    meg, batch, _ = _trained(mg, experts=0, steps=1)
    good = meg.save_checkpoint(tmp_path / "good")
    want = meg.compute_log_probs(batch).log_probs
    meg.close()
    for layout, path in ((None, tmp_path / "old"), ("te", tmp_path / "te")):
        shutil.copytree(good, path)
        state = torch.load(path / TRAINER_STATE_FILE, weights_only=True)
        state.pop("layout")
        torch.save(state if layout is None else {**state, "layout": layout},
                   path / TRAINER_STATE_FILE)
    old = MegatronTrainEngine.from_checkpoint(tmp_path / "old", launcher="local")
    assert torch.equal(old.compute_log_probs(batch).log_probs, want)
    old.close()
    with pytest.raises(CheckpointError, match="layer spec, which needs TE and a GPU") as err:
        MegatronTrainEngine.from_checkpoint(tmp_path / "te", launcher="local")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["missing", "empty", "file", "hf_only"])
def test_no_engine_from_a_missing_or_empty_directory(mg, tmp_path, kind):
    path = tmp_path / "ckpt"
    if kind == "empty":
        path.mkdir()
    elif kind == "file":
        path.write_text("x")
    elif kind == "hf_only":
        path = mg.hf_dir()
    with pytest.raises(CheckpointError) as err:
        MegatronTrainEngine.from_checkpoint(path, launcher="local")
    assert "\n" not in str(err.value)
    if kind != "hf_only":
        with pytest.raises(CheckpointError, match=r"does not exist|is empty|not a directory"):
            MegatronTrainEngine.from_pretrained(path, launcher="local")


def test_embedded_checkpoint_is_not_a_megatron_one(mg, tmp_path):
    from training.engines.embedded.trainer import EmbeddedTrainEngine

    EmbeddedTrainEngine.from_pretrained(mg.hf_dir()).save_checkpoint(tmp_path / "emb")
    with pytest.raises(CheckpointError, match="not a megatron trainer state"):
        MegatronTrainEngine.from_checkpoint(tmp_path / "emb", launcher="local")


def test_in_process_engines_are_world_size_one():
    with pytest.raises(ValueError, match="launcher='ray'"):
        MegatronTrainEngine.from_pretrained("unused", launcher="local",
                                            settings=MegatronSettings(tensor_parallel=2))
    with pytest.raises(ValueError, match="launcher='ray'"):
        MegatronTrainEngine.from_pretrained("unused", launcher="local",
                                            settings=MegatronSettings(pipeline_parallel=2))


def test_a_layout_that_cannot_run_the_model_is_refused_before_any_rank_starts(mg):
    """Checked on the driver from config.json: no Ray actor is started (Ray is not even
    initialised here) and the message names the fix."""
    import ray

    cases = [(mg.hf_dir(4), MegatronSettings(tensor_parallel=2), "with an MoE model"),
             (mg.hf_dir(0), MegatronSettings(pipeline_parallel=3),
              "pipeline_parallel=3 must divide num_layers=2")]
    for d, settings, message in cases:
        for build in (MegatronTrainEngine.from_pretrained, MegatronTrainEngine.from_checkpoint):
            with pytest.raises(ValueError, match=message):
                build(d, settings=settings)
    assert not ray.is_initialized()


def test_distributed_optimizer_trains_and_resumes_exactly(mg, tmp_path):
    """Megatron's DistributedOptimizer (world size 1 here; DP=2 in test_ray): the same steps as
    the embedded AdamW, and an exact resume (Adam moments *and* step count)."""
    import math

    from training.engines.embedded.trainer import EmbeddedTrainEngine

    settings = MegatronSettings(distributed_optimizer=True)
    emb = EmbeddedTrainEngine.from_pretrained(mg.hf_dir(4), optim=mg.OPTIM)
    meg = MegatronTrainEngine.from_pretrained(mg.hf_dir(4), optim=mg.OPTIM, settings=settings,
                                              launcher="local")
    batch = mg.batch()
    old = emb.compute_log_probs(batch).log_probs
    for seed in (2, 3):
        me = emb.train_step(batch, mg.adv(batch, seed), old, config=MICRO_BATCHES_OF_3)
        mm = meg.train_step(batch, mg.adv(batch, seed), old, config=MICRO_BATCHES_OF_3)
        assert math.isclose(mm["train/grad_norm"], me["train/grad_norm"], rel_tol=1e-5)
    path = meg.save_checkpoint(tmp_path / "dist")
    with pytest.raises(CheckpointError, match="distributed_optimizer=True"):
        MegatronTrainEngine.from_checkpoint(path, launcher="local")  # FP32-optimizer engine
    fresh = MegatronTrainEngine.from_checkpoint(path, settings=settings, launcher="local")
    ma = meg.train_step(batch, mg.adv(batch, 4), old)
    mb = fresh.train_step(batch, mg.adv(batch, 4), old)
    assert ma["train/loss"] == mb["train/loss"] and ma["train/grad_norm"] == mb["train/grad_norm"]
    pa, pb = meg.hf_state_dict(), fresh.hf_state_dict()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    meg.close()
    fresh.close()
