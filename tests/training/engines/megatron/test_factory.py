"""training.engines.factory: the recipe's engines.train picks the backend; a missing megatron-core
is a one-line recipe error naming the install command."""

import sys

import pytest
import torch

from training.engines.factory import (
    MEGATRON_MISSING,
    TrainBackendUnavailable,
    check_train_backend,
    make_reference_engine,
    make_train_engine,
)
from training.engines.train import OptimConfig, TrainEngine
from training.recipe import RecipeError, recipe_from_dict


def _recipe(train: str, moe_experts: int = 0, **megatron):
    return recipe_from_dict({"engines": {"train": train, "megatron": megatron},
                             "model": {"kind": "warmstart", "moe_experts": moe_experts}})


def test_megatron_without_megatron_core_is_a_one_line_recipe_error(monkeypatch):
    for name in ("megatron", "megatron.core"):  # as if megatron-core were not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(TrainBackendUnavailable) as err:
        check_train_backend(_recipe("megatron"))
    assert isinstance(err.value, RecipeError)
    assert str(err.value) == MEGATRON_MISSING == (
        'engines.train: megatron needs megatron-core; install it with pip install -e '
        '".[megatron]"')
    with pytest.raises(TrainBackendUnavailable):
        make_train_engine(_recipe("megatron"), init_dir="unused", resume_dir=None,
                          optim=OptimConfig())
    check_train_backend(_recipe("embedded"))  # the embedded backend needs nothing more


def test_factory_builds_the_backend_the_recipe_names(mg):
    pytest.importorskip("megatron.core")
    from training.engines.embedded.trainer import EmbeddedTrainEngine
    from training.engines.megatron.engine import MegatronTrainEngine

    check_train_backend(_recipe("megatron"))
    emb = make_train_engine(_recipe("embedded"), init_dir=mg.hf_dir(), resume_dir=None,
                            optim=OptimConfig(lr=1e-3))
    assert isinstance(emb, EmbeddedTrainEngine) and emb.optim.lr == 1e-3
    meg = make_train_engine(_recipe("megatron"), init_dir=mg.hf_dir(), resume_dir=None,
                            optim=OptimConfig(lr=1e-3), launcher="local")
    assert isinstance(meg, MegatronTrainEngine) and isinstance(meg, TrainEngine)
    assert meg.settings.world_size == 1 and meg.weight_version == 0
    ref = make_reference_engine(_recipe("megatron"), mg.hf_dir(), launcher="local")
    assert isinstance(ref, MegatronTrainEngine) and ref.snapshot_info()["budget_bytes"] == 0
    batch = mg.batch()  # the KL reference scores tokens like the (untrained) trainer
    torch.testing.assert_close(ref.compute_log_probs(batch).log_probs,
                               emb.compute_log_probs(batch).log_probs, atol=1e-5, rtol=0)
    meg.close()
    ref.close()
    with pytest.raises(ValueError, match="needs the reference model"):
        make_reference_engine(_recipe("megatron"), None)


def test_recipe_sizes_reach_the_engine_settings():
    pytest.importorskip("megatron.core")
    from training.engines.factory import megatron_settings

    s = megatron_settings(_recipe("megatron", tensor_parallel=2, data_parallel=3,
                                  distributed_optimizer=True, placement_strategy="SPREAD",
                                  gpus_per_rank=0.5, precision="bf16").engines.megatron)
    assert (s.tensor_parallel, s.data_parallel, s.world_size, s.distributed_optimizer,
            s.placement_strategy, s.gpus_per_rank, s.precision) == (2, 3, 6, True, "SPREAD", 0.5,
                                                                    "bf16")
    assert megatron_settings(_recipe("megatron").engines.megatron).precision == "fp32"


def test_parallel_sizes_are_checked_up_front():
    pytest.importorskip("megatron.core")
    from training.engines.megatron.engine import MegatronSettings

    check_train_backend(_recipe("megatron", pipeline_parallel=2))
    with pytest.raises(ValueError, match="expert_parallel=2 must divide data_parallel=3"):
        MegatronSettings(expert_parallel=2, data_parallel=3)
    check_train_backend(_recipe("megatron", moe_experts=4, expert_parallel=2, data_parallel=2))
