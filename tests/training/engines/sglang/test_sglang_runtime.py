"""The runtime on the SGLang backend path, without GPUs: ``engines.rollout: sglang`` with the
fleet's launch command replaced by the embedded server (the same HTTP API). Engines start as Ray
actors in a placement group, weights are synced from disk and told to the actors, an engine killed
mid-run comes back with the current weights, and nothing outlives the run."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from training.engines.sglang import fleet as fleet_module
from training.engines.sglang import launch
from training.recipe import recipe_from_dict
from training.runtime.run import Runtime
from training.runtime.sinks import read_metrics

COMMAND = [sys.executable, "-m", "training.engines.embedded.server", "--checkpoint",
           "{model_path}", "--host", "{host}", "--port", "{port}", "--dtype", "bf16",
           "--threads", "1", "--log-level", "warning"]


@pytest.fixture
def sglang_stand_in(monkeypatch):
    """SGLang "installed"; its servers are embedded servers on no GPU."""
    monkeypatch.setattr(launch, "_installed", lambda module: True)

    class StandInFleet(fleet_module.SGLangFleet):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, command=COMMAND, gpus_per_engine=0, **kwargs)

    monkeypatch.setattr(fleet_module, "SGLangFleet", StandInFleet)


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_run_on_the_sglang_path_survives_an_engine_restart(ray_session, sglang_stand_in,
                                                             tmp_path):
    recipe = recipe_from_dict({
        "name": "sglang-path", "steps": 4,
        "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32,
                  "num_layers": 2},
        "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 24},
        "async": {"mode": "one_step"}, "eval": {"every": 0, "n": 0},
        "engines": {"rollout": "sglang", "num_rollout_engines": 1,
                    "sglang": {"startup_timeout_s": 120, "max_restarts": 2}},
    })
    rt = Runtime(recipe, out=tmp_path / "run", steps=None, resume=False, ray_address=None,
                 sinks=[], progress=None, checkpoint_every=0)
    seen: dict[int, dict] = {}

    def on_step(step, total, metrics):
        (st,) = rt.backend.fleet.statuses(ray_session)
        seen[step] = st
        if step == 2:  # the engine crashes after the sync that followed step 2
            os.kill(st["pid"], signal.SIGKILL)

    rt.progress = on_step
    res = rt.run()
    assert res.steps_done == 4 and not res.interrupted
    rows = [r for r in read_metrics(res.metrics_path) if not r.get("step/eval_only")]
    versions = [r["step/weight_version"] for r in rows]
    assert versions == sorted(versions) and len(set(versions)) == 4
    # after each sync the actor knows the fleet's weights: the export of that version
    assert seen[1]["weights_path"] == str(tmp_path / "run" / "weights" / f"v{versions[0]:.0f}")
    assert seen[1]["weight_version"] == versions[0]
    # the killed engine was relaunched on its port, from the current weights, and served again
    assert seen[4]["launches"] == 2 and seen[4]["restarts"] == 1
    assert seen[4]["url"] == seen[1]["url"] and seen[4]["state"] == "ready"
    assert rows[-1]["async/trained_samples"] == 4 * 16
    # the run stopped its engines and the fleet
    assert rt.backend.fleet is None
    assert _gone(seen[4]["pid"], 10)


def _router_log(fleet_log_dir) -> str:
    """The router's log without its colour codes."""
    import re

    text = "".join(p.read_text(errors="replace") for p in fleet_log_dir.glob("sglang-router-*.log"))
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.mark.slow
def test_a_run_behind_the_real_sglang_router_syncs_each_engine_directly(
        ray_session, sglang_stand_in, tmp_path):
    """``router: sglang-router`` (the real one, pip install sglang-router) over two stand-in
    engines, fully async with partial rollout: every request goes through the router; pauses,
    continues and weight loads go to each engine directly (the router has none of them)."""
    pytest.importorskip("sglang_router")
    recipe = recipe_from_dict({
        "name": "sglang-router-path", "steps": 3,
        "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32,
                  "num_layers": 2},
        "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 24},
        "async": {"mode": "fully_async", "staleness_threshold": 1.0, "partial_rollout": True,
                  "max_ahead_steps": 1},
        "eval": {"every": 0, "n": 0},
        "engines": {"rollout": "sglang", "num_rollout_engines": 2,
                    "sglang": {"router": "sglang-router", "startup_timeout_s": 120}},
    })
    rt = Runtime(recipe, out=tmp_path / "run", steps=None, resume=False, ray_address=None,
                 sinks=[], progress=None, checkpoint_every=0)
    seen: dict[int, list[dict]] = {}

    def on_step(step, total, metrics):
        import httpx

        seen[step] = [{**st, "info": httpx.get(st["url"] + "/server_info").json()}
                      for st in rt.backend.fleet.statuses(ray_session)]
        fleet = rt.backend.fleet
        seen[step].append({"router_url": fleet.router_url, "log_dir": fleet.log_dir})

    rt.progress = on_step
    res = rt.run()
    assert res.steps_done == 3 and not res.interrupted
    rows = [r for r in read_metrics(res.metrics_path) if not r.get("step/eval_only")]
    versions = [r["step/weight_version"] for r in rows]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert rows[-1]["async/rollouter/syncs"] == 3
    # SGLang's partial rollouts abort and resume (async.interrupt auto): an aborted request is
    # continued from its tokens, never redone; a sample spanning a sync was resumed
    assert rows[-1]["async/rollouter/sample_retries"] == 0
    if any(r["async/partial_ratio"] > 0 for r in rows):
        assert rows[-1]["async/rollouter/resumed_requests"] > 0
    # the rollouter's client saw one "engine": the router
    assert rows[-1]["async/engines_admitted"] == 1
    *engines, extra = seen[3]
    assert extra["router_url"] not in {e["url"] for e in engines}
    for e in engines:  # each engine was loaded directly, paused and resumed, and served
        st = e["info"]["internal_states"][0]
        assert e["weight_version"] == versions[-1] == float(e["info"]["weight_version"])
        assert st["weight_updates"] == 3 and st["requests_finished"] > 0
    log = _router_log(extra["log_dir"])
    assert "uri=/generate" in log
    for path in ("/update_weights_from_disk", "/pause_generation", "/continue_generation"):
        assert f"uri={path}" not in log
    assert rt.backend.fleet is None


@pytest.mark.slow
def test_nccl_weight_sync_on_the_sglang_path_with_gloo(ray_session, sglang_stand_in, tmp_path):
    """``weight_sync: nccl`` end to end on CPU (gloo): Megatron trainer, stand-in engines that
    join the weight group themselves; the trainer actor broadcasts every sync (no export on
    disk), and after an engine restart the group is made again under a new name."""
    pytest.importorskip("megatron.core")
    from training.runtime.actors import TrainerWorker

    # the real trainer actor has the broadcast methods (they run on Megatron rank 0)
    assert hasattr(TrainerWorker, "init_weight_sync_nccl")
    assert hasattr(TrainerWorker, "push_weights_nccl")
    recipe = recipe_from_dict({
        "name": "sglang-nccl", "steps": 4,
        "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32,
                  "num_layers": 2},
        "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 24},
        "async": {"mode": "one_step"}, "eval": {"every": 0, "n": 0},
        "engines": {"rollout": "sglang", "train": "megatron", "num_rollout_engines": 1,
                    "sglang": {"weight_sync": "nccl", "startup_timeout_s": 120,
                               "max_restarts": 2}},
    })
    rt = Runtime(recipe, out=tmp_path / "run", steps=None, resume=False, ray_address=None,
                 sinks=[], progress=None, checkpoint_every=0)
    rt.weight_sync_backend = "gloo"
    seen: dict[int, dict] = {}

    def on_step(step, total, metrics):
        import httpx

        (st,) = rt.backend.fleet.statuses(ray_session)
        seen[step] = {**st, "served": httpx.get(st["url"] + "/model_info").json(),
                      "metrics": metrics}
        if step == 2:  # the engine crashes after the sync that followed step 2
            os.kill(st["pid"], signal.SIGKILL)

    rt.progress = on_step
    res = rt.run()
    assert res.steps_done == 4 and not res.interrupted
    rows = [r for r in read_metrics(res.metrics_path) if not r.get("step/eval_only")]
    versions = [r["step/weight_version"] for r in rows]
    assert versions == sorted(versions) and len(set(versions)) == 4
    # every sync was a broadcast the engine reports the version of; nothing was exported
    for step in (1, 2, 4):
        assert seen[step]["served"]["weight_version"] == f"{versions[step - 1]:.0f}"
        assert seen[step]["served"]["model_path"].startswith("(broadcast over asyncrl-weights-")
        assert seen[step]["metrics"]["async/weight_sync_bytes"] > 0
    assert not (tmp_path / "run" / "weights").exists()
    # the restarted engine joined a new group: one per launch
    assert seen[4]["launches"] == 2 and seen[4]["restarts"] == 1
    groups = [seen[step]["served"]["model_path"] for step in (1, 2, 4)]
    assert groups == ["(broadcast over asyncrl-weights-1)"] * 2 + \
        ["(broadcast over asyncrl-weights-2)"]
    assert rows[-1]["async/trained_samples"] == 4 * 16
    assert rt.backend.fleet is None
