"""The runtime's parts chosen once from the recipe: the rollout backend and the parameter
synchroniser's transport (training.runtime.backends, training.runtime.weight_sync). Their runs are
tested end to end in test_runtime.py (embedded, disk) and tests/training/engines/sglang (SGLang
fleet, sglang-router direct loads, the gloo broadcast)."""

from pathlib import Path

import pytest

from training.recipe import recipe_from_dict
from training.runtime.backends import EmbeddedBackend, SGLangBackend, rollout_backend
from training.runtime.placement import RunPlacement
from training.runtime.weight_sync import (
    DirectSync,
    DiskSync,
    NcclSync,
    SyncError,
    parameter_sync,
)


def _recipe(**engines):
    data = {"name": "t", "engines": engines}
    if engines.get("sglang", {}).get("weight_sync") == "nccl":
        data["engines"]["train"] = "megatron"
    return recipe_from_dict(data)


CASES = [
    ({}, EmbeddedBackend, "disk", DiskSync),
    ({"rollout": "sglang"}, SGLangBackend, "disk", DiskSync),
    ({"rollout": "sglang", "sglang": {"router": "sglang-router"}}, SGLangBackend, "direct",
     DirectSync),
    ({"rollout": "sglang", "sglang": {"weight_sync": "nccl"}}, SGLangBackend, "nccl", NcclSync),
]


@pytest.mark.parametrize(("engines", "backend_type", "transport", "sync_type"), CASES)
def test_backend_and_transport_follow_the_recipe(tmp_path, engines, backend_type, transport,
                                                 sync_type):
    recipe = _recipe(**engines)
    assert recipe.engines.weight_transport == transport
    backend = rollout_backend(recipe, tmp_path / "run", RunPlacement(recipe))
    assert type(backend) is backend_type
    sync = parameter_sync(recipe, tmp_path / "run", None, None, backend)
    assert type(sync) is sync_type
    if backend_type is SGLangBackend:  # SGLang logs live under the state directory, per run
        assert backend.log_dir().name == "run"
        assert backend.control_urls is None and backend.fleet is None
        assert not backend.alive(None) and backend.failure(None) == "the fleet never started"


def test_a_fleet_transport_refuses_embedded_engines(tmp_path):
    recipe = _recipe(rollout="sglang", sglang={"router": "sglang-router"})
    with pytest.raises(SyncError, match="needs SGLang engines"):
        parameter_sync(recipe, tmp_path, None, None, _embedded(recipe))


def test_versions_and_exports(tmp_path):
    recipe = recipe_from_dict({"name": "t", "async": {"mode": "fully_async",
                                                      "max_off_policy_steps": 1}})
    sync = parameter_sync(recipe, tmp_path, None, None, _embedded(recipe))
    sync.started_at(3, [1, 2])  # a resumed run that had synced versions 1 and 2, now serves 3
    assert sync.synced_versions == [1, 2, 3] and sync.last_synced == 3
    sync.started_at(3)
    assert sync.synced_versions == [1, 2, 3]
    # trainer steps 0..3 started from versions 1, 2, 3, 3: with max_off_policy_steps 1 the
    # oldest a kept sample can carry is the version of step len-2-1 = 1 → version 2
    assert sync.referenced_versions([1, 2, 3, 3]) == [2, 3]
    unlimited = parameter_sync(recipe_from_dict({"name": "t"}), tmp_path, None, None,
                               _embedded(recipe))
    unlimited.started_at(0, [0, 1, 2])
    assert unlimited.referenced_versions([0, 1, 2]) == [0, 1, 2]
    for v in range(1, 6):
        (tmp_path / "weights" / f"v{v}").mkdir(parents=True)
    (tmp_path / "weights" / "vlatest").mkdir()  # not a version: left alone
    sync._prune_exports(5, tmp_path / "weights" / "v5")
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v4", "v5", "vlatest"]


def test_embedded_backend_without_servers(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path))
    recipe = recipe_from_dict({"name": "t"})
    backend = rollout_backend(recipe, tmp_path / "run", RunPlacement(recipe))
    assert backend.log_dir() == Path(tmp_path) / "logs" / "run"
    assert not backend.alive(None)
    backend.stop(None)  # nothing started: nothing to stop


def test_run_state_round_trips_and_reads_older_files():
    from training.runtime.types import RolloutState, RunCounters, RunState

    state = RunState(step=4, step_start_versions=[0, 1, 2, 3], synced_versions=[0, 2],
                     consumed_samples=64, counters=RunCounters(trained_samples=60),
                     rollouter=RolloutState(next_group_id=20, regenerate=[17, 19],
                                            policy_step=4, controller={"a": 1},
                                            dispatcher={"b": [2]}),
                     init_dir="/w", recipe_identity="i", recipe_hash="h", total_steps=8)
    import json

    data = json.loads(json.dumps(state.to_json()))
    assert data["rollouter"]["regenerate"] == [17, 19]
    assert RunState.from_json(data) == state
    # a runtime.json from before synced_versions, policy_step, regenerate and total_steps
    for key in ("synced_versions", "recipe_hash", "total_steps"):
        data.pop(key)
    for key in ("regenerate", "policy_step"):
        data["rollouter"].pop(key)
    old = RunState.from_json(data)
    assert (old.synced_versions, old.total_steps, old.rollouter.regenerate,
            old.rollouter.policy_step) == ([], 4, [], 0)
    with pytest.raises(KeyError):
        RunState.from_json({"step": 1})


def test_a_corrupt_run_state_is_one_line(tmp_path):
    from training.runtime.run import RunError, run_recipe

    run_dir = tmp_path / "run"
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "checkpoint" / "runtime.json").write_text('{"step": 2}')
    with pytest.raises(RunError) as err:
        run_recipe(recipe_from_dict({"name": "t"}), resume=run_dir)
    assert str(err.value) == (f"{run_dir / 'checkpoint' / 'runtime.json'} is not a run state "
                              "(KeyError: 'step_start_versions'); resume from another run "
                              "directory or start afresh")


def test_embedded_servers_run_on_ray_actors_with_the_recipes_thread_count(
        tmp_path, monkeypatch, ray_session):
    """Real servers from the backend, each launched by its actor in its bundle of the run's
    placement group: each reports the recipe's thread count in /server_info, the bundles hold
    the threads as CPUs, and stopping the backend stops the server processes (by PID)."""
    import httpx

    from training.engines.hf_io import save_hf_dir
    from training.engines.model import CausalLM, ModelConfig
    from training.tasks.tokenizer import CharTokenizer

    ray = ray_session
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))  # the servers' logs
    cfg = ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, intermediate_size=48,
                      max_position_embeddings=64)
    ckpt = save_hf_dir(tmp_path / "ckpt", CausalLM(cfg).init_weights(0, std=0.1), CharTokenizer())
    recipe = _recipe(num_rollout_engines=2, rollout_threads=2)
    placement = RunPlacement(recipe)
    backend = EmbeddedBackend(recipe, tmp_path / "logs", placement)
    placement.reserve(ray)
    assert placement.bundles == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}]
    try:
        urls = backend.start(ray, ckpt)
        where = backend.where(ray)
        infos = [httpx.get(u + "/server_info", timeout=10).json() for u in urls]
        assert [i["threads"] for i in infos] == [2, 2]
        assert backend.alive(ray)
        pids = [w["pid"] for w in where]
        assert all(isinstance(p, int) and Path(f"/proc/{p}").exists() for p in pids)
    finally:
        backend.stop(ray)
        placement.release(ray)
    import time
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    assert not any(Path(f"/proc/{p}").exists() for p in pids)  # stopped


@pytest.mark.slow  # ≈12 s: a server killed and started again
def test_a_dead_embedded_server_is_restarted_by_its_actor(tmp_path, monkeypatch, ray_session):
    """kill -9 of a server: its actor starts it again on the same port, from the newest weights
    the run named (set_weights), and it answers again."""
    import os
    import signal
    import time

    import httpx

    from training.engines.hf_io import save_hf_dir
    from training.engines.model import CausalLM, ModelConfig
    from training.tasks.tokenizer import CharTokenizer

    ray = ray_session
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))
    cfg = ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, intermediate_size=48,
                      max_position_embeddings=64)
    ckpt = save_hf_dir(tmp_path / "ckpt", CausalLM(cfg).init_weights(0, std=0.1), CharTokenizer())
    newer = save_hf_dir(tmp_path / "v1", CausalLM(cfg).init_weights(1, std=0.1), CharTokenizer())
    recipe = _recipe(num_rollout_engines=1)
    placement = RunPlacement(recipe)
    backend = EmbeddedBackend(recipe, tmp_path / "logs", placement)
    placement.reserve(ray)
    try:
        (url,) = backend.start(ray, ckpt)
        backend.weights_are(ray, newer, 1)
        (before,) = backend.where(ray)
        os.kill(before["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        after = before
        while time.monotonic() < deadline:
            (after,) = backend.where(ray)
            if after["restarts"] == 1 and after["pid"] != before["pid"]:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
        assert after["restarts"] == 1 and after["pid"] != before["pid"]
        assert after["url"] == url
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["model_path"] == str(newer)
    finally:
        backend.stop(ray)
        placement.release(ray)


def _embedded(recipe):
    return EmbeddedBackend(recipe, Path("logs") / "run", RunPlacement(recipe))


def test_thread_counts_count_in_the_hash_only_when_set():
    base = _recipe()
    assert _recipe(rollout_threads=1, train_threads=1).hash() == base.hash()
    assert len({base.hash(), _recipe(rollout_threads=2).hash(),
                _recipe(train_threads=2).hash()}) == 3
