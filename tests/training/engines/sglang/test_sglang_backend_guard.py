"""Choosing the SGLang backend where it cannot run: one line through `asyncrl train`, before any
warm start; the run-start checks for sglang-router and the weight-sync paths."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from training.engines.sglang import launch
from training.engines.sglang.launch import ROUTER_MISSING, SGLANG_MISSING
from training.recipe import recipe_from_dict
from training.runtime.run import RunError, check_rollout_backend, run_recipe
from ui.cli import app

SGLANG_RECIPE = """\
name: sglang-tiny
steps: 2
model: {kind: warmstart, warmstart_steps: 5000}
engines: {rollout: sglang, sglang: {tp_size: 1}}
"""


@pytest.fixture
def installed(monkeypatch):
    """Pretend which of sglang / sglang_router are importable (here neither is)."""
    present: set[str] = set()
    monkeypatch.setattr(launch, "_installed", lambda module: module in present)
    return present


def test_asyncrl_train_with_sglang_and_no_gpu_extra_is_one_line(tmp_path, installed):
    path = tmp_path / "sglang.yaml"
    path.write_text(SGLANG_RECIPE)
    res = CliRunner().invoke(app, ["train", str(path), "--out", str(tmp_path / "run")])
    assert res.exit_code == 1, res.output
    assert res.stderr.strip() == f"error: {SGLANG_MISSING}"
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    assert SGLANG_MISSING == ('engines.rollout: sglang needs SGLang on a GPU node; install it '
                              'with pip install -e ".[gpu]"')
    # refused before the 5000-step warm start and before anything was written
    assert "warm start" not in res.output and not (tmp_path / "run").exists()


def test_run_recipe_refuses_before_creating_the_run_dir(tmp_path, installed):
    recipe = recipe_from_dict({"name": "s", "engines": {"rollout": "sglang"}})
    with pytest.raises(RunError, match=r"pip install -e \"\.\[gpu\]\"") as err:
        run_recipe(recipe, out=tmp_path / "run")
    assert str(err.value) == SGLANG_MISSING and not (tmp_path / "run").exists()


def test_sglang_router_with_r3_is_refused_at_run_start(installed):
    installed.update({"sglang", "sglang_router"})
    base = recipe_from_dict({"name": "moe", "model": {"kind": "warmstart", "moe_experts": 4},
                             "algorithm": {"routing_replay": "r3"},
                             "engines": {"rollout": "sglang"}})
    # the recipe validator refuses this combination too; the runtime does not rely on it
    engines = base.engines.model_copy(update={"sglang": base.engines.sglang.model_copy(
        update={"router": "sglang-router"})})
    recipe = base.model_copy(update={"engines": engines})
    with pytest.raises(RunError, match=r"drops return_routed_experts.*use router: asyncrl"):
        check_rollout_backend(recipe)


def test_sglang_router_needs_its_package(installed):
    installed.add("sglang")
    recipe = recipe_from_dict({"name": "r", "engines": {"rollout": "sglang",
                                                        "sglang": {"router": "sglang-router"}}})
    with pytest.raises(RunError) as err:
        check_rollout_backend(recipe)
    assert str(err.value) == ROUTER_MISSING


def test_disk_sync_with_asyncrl_router_passes_and_embedded_needs_nothing(installed):
    check_rollout_backend(recipe_from_dict({"name": "e"}))  # embedded: nothing to check
    installed.add("sglang")
    check_rollout_backend(recipe_from_dict({"name": "s", "engines": {"rollout": "sglang"}}))


def test_nccl_sync_needs_the_trainer_actors_broadcast_methods(installed, monkeypatch):
    installed.add("sglang")
    recipe = recipe_from_dict({"name": "n", "engines": {
        "rollout": "sglang", "train": "megatron", "sglang": {"weight_sync": "nccl"}}})
    from training.runtime import actors

    class WithoutPush:  # a trainer actor without the two methods
        pass

    real = actors.TrainerWorker  # has them (they run on Megatron rank 0)
    monkeypatch.setattr(actors, "TrainerWorker", WithoutPush)
    with pytest.raises(RunError, match=r"push_weights_nccl.*use weight_sync: disk"):
        check_rollout_backend(recipe)
    monkeypatch.setattr(actors, "TrainerWorker", real)
    check_rollout_backend(recipe)


def test_sglang_router_runs_with_partial_rollout_and_disk_sync(installed):
    # behind the router the rollouter pauses, continues and loads weights on each engine
    installed.update({"sglang", "sglang_router"})
    check_rollout_backend(recipe_from_dict({"name": "r", "async": {
        "mode": "fully_async", "partial_rollout": True}, "engines": {
        "rollout": "sglang", "sglang": {"router": "sglang-router"}}}))
