"""The warm start's robustness hooks (issue 26): micro_batches, order_seed, threads."""

import pytest
import torch

from training.engines.model import CausalLM
from training.engines.warmstart import (
    WarmStartConfig,
    config_hash,
    free_cores,
    train_supervised,
    warm_start,
)
from training.tasks.tokenizer import CharTokenizer

TINY = WarmStartConfig(task_args=(("max_k", 3),), hidden_size=32, num_layers=2, num_heads=2,
                       intermediate_size=64, max_position_embeddings=64, steps=3, batch_size=8,
                       warmup_steps=1, eval_n=12, eval_batch_size=16)


pytestmark = pytest.mark.usefixtures("fresh_home")


def losses_of(cfg: WarmStartConfig, steps: int = 2) -> list[float]:
    tok = CharTokenizer()
    model = CausalLM(cfg.model_config(tok)).init_weights(cfg.seed)
    return train_supervised(model, tok, cfg.build_task(), cfg, steps=steps, lr=cfg.lr)


@pytest.mark.parametrize("change", [{"micro_batches": 2}, {"micro_batches": 3},
                                    {"order_seed": 7}])
def test_micro_batches_and_order_give_the_same_step_up_to_rounding(change):
    base = losses_of(TINY)
    other = losses_of(WarmStartConfig(**{**vars(TINY), **change}))
    # step 1: the same weights and examples, so the same loss; step 2 after the same update
    assert other[0] == pytest.approx(base[0], rel=1e-5)
    assert other[1] == pytest.approx(base[1], rel=1e-3)


def test_hooks_in_the_cache_key_and_the_recorded_config():
    task = TINY.build_task()
    base = config_hash(TINY, task)
    # at their neutral values the hooks are not in the key: checkpoints cached before them hold
    assert not {"micro_batches", "order_seed", "threads"} & set(TINY.to_dict())
    for change in ({"micro_batches": 2}, {"order_seed": 0}):
        assert config_hash(WarmStartConfig(**{**vars(TINY), **change}), task) != base, change
    # threads is an execution resource: recorded when set, never in the key
    assert config_hash(WarmStartConfig(**{**vars(TINY), "threads": 1}), task) == base
    assert WarmStartConfig(**{**vars(TINY), "threads": 1}).to_dict()["threads"] == 1


def test_hook_validation():
    with pytest.raises(ValueError, match="micro_batches"):
        WarmStartConfig(**{**vars(TINY), "micro_batches": 9})
    with pytest.raises(ValueError, match="micro_batches"):
        WarmStartConfig(**{**vars(TINY), "micro_batches": 0})
    with pytest.raises(ValueError, match="threads"):
        WarmStartConfig(**{**vars(TINY), "threads": 0})


def test_threads_are_set_for_the_warm_start_and_restored(tmp_path):
    before = torch.get_num_threads()
    res = warm_start(WarmStartConfig(**{**vars(TINY), "threads": 1}), tmp_path / "a")
    assert res.meta["threads"] == 1 and torch.get_num_threads() == before
    auto = warm_start(TINY, tmp_path / "b")
    assert 1 <= auto.meta["threads"] <= len(__import__("os").sched_getaffinity(0))
    assert torch.get_num_threads() == before
    assert auto.meta["train_cpu_seconds"] >= 0


def test_free_cores_is_within_the_affinity():
    import os

    n = free_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
