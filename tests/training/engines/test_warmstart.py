import json
import math
import time

import pytest
import torch

from training.engines.hf_io import load_hf_dir, read_state_dict
from training.engines.model import CausalLM, ModelConfig
from training.engines.warmstart import (
    IGNORE,
    WarmStartConfig,
    collate,
    config_hash,
    expert_divergence,
    lr_factor,
    upcycle_to_moe,
    warm_start,
)
from training.tasks.registry import get_task
from training.tasks.tokenizer import CharTokenizer

TINY = WarmStartConfig(task_args=(("max_k", 3),), hidden_size=32, num_layers=2, num_heads=2,
                       intermediate_size=64, max_position_embeddings=64, steps=3, batch_size=8,
                       warmup_steps=1, eval_n=12, eval_batch_size=16,
                       threads=1)  # a fixed thread count: bit-identical retrains


@pytest.fixture(autouse=True)
def home(fresh_home):
    return fresh_home


def events_of(run):
    events = []
    return events, (lambda *a, **kw: run(*a, progress=events.append, **kw))


def test_collate_masks_prompt_and_padding_and_keeps_eos():
    tok = CharTokenizer()
    ids, labels = collate(tok, ["1=", "2+3="], ["1", "2,5"])
    bos, eos, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    enc = tok.encode
    # row 0: <bos> 1 = 1 | <eos> is predicted at the last input position
    assert ids[0].tolist() == [bos, *enc("1=1"), pad, pad, pad, pad]
    assert labels[0].tolist() == [IGNORE, IGNORE, *enc("1"), eos, IGNORE, IGNORE, IGNORE, IGNORE]
    assert ids[1].tolist() == [bos, *enc("2+3=2,5")]
    assert labels[1].tolist() == [IGNORE] * 4 + [*enc("2,5"), eos]


def test_lr_schedule_values():
    # warm-up: (step + 1) / warmup
    assert lr_factor(0, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "cosine", 0.1) == pytest.approx(1.0)
    # half-way through the decay: cosine gives 0.1 + 0.9 * 0.5, linear the same
    assert lr_factor(55, 100, 10, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(55, 100, 10, "linear", 0.1) == pytest.approx(0.55)
    assert lr_factor(100, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(40, 100, 10, "cosine", 0.0) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 30 / 90)))


def test_warm_start_writes_a_loadable_checkpoint_and_the_cache_skips_training(tmp_path, home):
    events = []
    first = warm_start(TINY, tmp_path / "a", progress=events.append)
    assert not first.cache_hit and first.path == tmp_path / "a"
    assert [e.step for e in events if e.phase == "train"] == [1, 2, 3]
    assert events[-1].phase == "eval"
    ckpt = load_hf_dir(first.path)
    assert ckpt.weight_version == 0 and not ckpt.config.is_moe
    assert ckpt.meta["config_hash"] == first.config_hash
    assert ckpt.meta["task"]["name"] == "sum_digits" and ckpt.meta["config"]["steps"] == 3
    assert [r["difficulty"] for r in ckpt.meta["eval"]] == [1, 2, 3, "all"]
    assert json.loads((first.path / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]
    assert (home / "cache" / "warmstart" / f"sum_digits-{first.config_hash}").is_dir()

    events.clear()
    start = time.perf_counter()
    second = warm_start(TINY, tmp_path / "b", progress=events.append)
    assert second.cache_hit and events == [] and time.perf_counter() - start < 2.0
    assert second.meta == first.meta
    a, b = read_state_dict(first.path), read_state_dict(second.path)
    assert all(torch.equal(a[k], b[k]) for k in a)

    # --no-cache retrains; the same seed gives the same weights
    third = warm_start(TINY, tmp_path / "c", use_cache=False, progress=events.append)
    assert not third.cache_hit and len(events) == 4
    c = read_state_dict(third.path)
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_cache_key_covers_the_config_and_the_data(tmp_path):
    task = TINY.build_task()
    base = config_hash(TINY, task)
    assert config_hash(TINY, task) == base
    for change in ({"seed": 1}, {"lr": 1e-3}, {"steps": 4}, {"task_args": (("max_k", 4),)}):
        cfg = WarmStartConfig(**{**vars(TINY), **change})
        assert config_hash(cfg, cfg.build_task()) != base, change
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    cfg = WarmStartConfig(task="jsonl", task_args=(("path", str(data)),))
    before = config_hash(cfg, cfg.build_task())
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "3"}\n')
    assert config_hash(cfg, cfg.build_task()) != before


def test_refuses_to_overwrite_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        warm_start(TINY, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "precious"


def test_config_validation():
    with pytest.raises(ValueError, match="moe_top_k"):
        WarmStartConfig(moe_experts=2, moe_top_k=3)
    with pytest.raises(ValueError, match="schedule"):
        WarmStartConfig(schedule="step")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="valid names"):
        WarmStartConfig(task="nope").build_task()


@pytest.mark.parametrize("experts, top_k", [(4, 2), (3, 1), (8, 8)])
def test_upcycled_moe_computes_exactly_the_dense_function(experts, top_k):
    """Identical experts + renormalised top-k weights: the MoE block equals the dense MLP whatever
    the router chooses, so the logits match although tokens are routed to different experts."""
    cfg = ModelConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                      intermediate_size=48)
    dense = CausalLM(cfg).init_weights(seed=0, std=0.2).eval()
    moe = upcycle_to_moe(dense, experts, top_k, seed=1, router_std=1.0)
    assert moe.config.is_moe and moe.config.num_experts == experts
    ids = torch.randint(4, 100, (3, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        dense_logits, _ = dense(ids)
        moe_logits, routes = moe(ids)
    torch.testing.assert_close(moe_logits, dense_logits, rtol=1e-5, atol=1e-5)
    assert routes.shape == (3, 10, 2, top_k)
    if top_k < experts:
        assert routes[..., 0].unique().numel() > 1  # the router really spreads the tokens
    layer = moe.model.layers[0]
    torch.testing.assert_close(layer.block_sparse_moe.experts[experts - 1].w2.weight,
                               dense.model.layers[0].mlp.down_proj.weight)
    assert expert_divergence(moe) == 0.0
    with pytest.raises(ValueError, match="already MoE"):
        upcycle_to_moe(moe, 2, 1)


def test_moe_warm_start_upcycles_the_cached_dense_checkpoint(tmp_path):
    cfg = WarmStartConfig(**{**vars(TINY), "moe_experts": 4, "moe_top_k": 2,
                             "moe_finetune_steps": 2})
    events = []
    res = warm_start(cfg, tmp_path / "moe", progress=events.append)
    assert [e.phase for e in events] == ["train"] * 3 + ["eval"] + ["moe_finetune"] * 2 + ["eval"]
    ckpt = load_hf_dir(res.path)
    assert ckpt.config.is_moe and ckpt.config.num_experts == 4
    assert json.loads((res.path / "config.json").read_text())["architectures"] == [
        "MixtralForCausalLM"]
    dense = warm_start(TINY)
    assert dense.cache_hit and ckpt.meta["upcycled_from"] == dense.config_hash
    assert ckpt.meta["kind"] == "warmstart_moe" and ckpt.meta["expert_divergence"] > 0
    assert warm_start(cfg).cache_hit


@pytest.mark.slow
def test_default_warm_start_reaches_the_accuracy_targets(tmp_path):
    """The issue's bar: <= ~3 min on 2 cores to greedy k=2 >= 0.9 and k=4 >= 0.4 (eval split)."""
    start = time.perf_counter()
    res = warm_start(WarmStartConfig(), tmp_path / "ws")
    elapsed = time.perf_counter() - start
    acc = {row["difficulty"]: row["accuracy"] for row in res.meta["eval"]}
    print(f"warm start {elapsed:.0f}s, accuracy per k: {acc}")
    assert acc[2] >= 0.9 and acc[4] >= 0.4
    assert get_task("sum_digits").difficulties() == [k for k in acc if k != "all"]
