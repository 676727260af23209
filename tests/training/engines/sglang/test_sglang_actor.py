"""SGLangEngineActor with a real server process that dies: the embedded server stands in for
``sglang.launch_server`` (same HTTP API), is SIGKILLed mid-test, restarted on the same port and
re-synced to the fleet's current weights; max_restarts exhausted is a clear error; a killed actor
takes its server with it. The client's SGLang contract runs against the same server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import httpx
import numpy as np
import pytest

from training.engines.client import RolloutClient
from training.engines.hf_io import save_hf_dir
from training.engines.model import CausalLM, ModelConfig
from training.engines.rollout import GenerateRequest, SamplingParams
from training.engines.sglang.actor import EngineStartError, SGLangEngineActor
from training.recipe import recipe_from_dict
from training.tasks.tokenizer import CharTokenizer

LAYERS, TOP_K = 2, 2


def _checkpoint(path, seed=0, version=0):
    cfg = ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32, num_layers=LAYERS,
                      num_heads=2, num_kv_heads=2, intermediate_size=48,
                      max_position_embeddings=256, num_experts=4, num_experts_per_tok=TOP_K)
    return save_hf_dir(path, CausalLM(cfg).init_weights(seed, std=0.15), CharTokenizer(),
                       weight_version=version)


def _embedded_command(checkpoint) -> list[str]:
    """The launch template: always the initial checkpoint, so a restart must be re-pushed."""
    return [sys.executable, "-m", "training.engines.embedded.server", "--checkpoint",
            str(checkpoint), "--host", "{host}", "--port", "{port}", "--dtype", "fp32",
            "--threads", "1", "--log-level", "warning"]


RECIPE = recipe_from_dict({
    "name": "sglang-actor-test",
    "model": {"kind": "warmstart", "moe_experts": 4, "moe_top_k": 2},
    "algorithm": {"routing_replay": "r3"},
    "engines": {"rollout": "sglang", "sglang": {"startup_timeout_s": 60, "max_restarts": 1}},
}).to_dict()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return _checkpoint(root / "v0", seed=0, version=0), _checkpoint(root / "v3", seed=1,
                                                                    version=3)


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _version(url: str) -> int:
    return int(httpx.get(url + "/model_info", timeout=5).json()["weight_version"])


@pytest.mark.slow
def test_killed_server_restarts_on_its_port_with_current_weights_then_gives_up(
        ray_session, ckpts, tmp_path):
    ray = ray_session
    v0, v3 = ckpts
    actor = ray.remote(SGLangEngineActor).options(max_concurrency=8).remote(
        RECIPE, 0, str(v0), 0, command=_embedded_command(v0), log_dir=str(tmp_path))
    try:
        url = ray.get(actor.start.remote())
        assert url.startswith("http://127.0.0.1:") and _version(url) == 0
        # the fleet moves to v3 (as the runtime's sync does), then the server crashes
        assert ray.get(actor.update_weights_from_disk.remote(str(v3), 3))["success"]
        assert _version(url) == 3
        pid = ray.get(actor.pid.remote())
        os.kill(pid, signal.SIGKILL)
        assert _gone(pid)
        assert ray.get(actor.wait_ready.remote(60.0))
        st = ray.get(actor.status.remote())
        assert (st["state"], st["launches"], st["restarts"]) == ("ready", 2, 1)
        assert st["url"] == url and st["pid"] != pid and st["deaths"][0]["pid"] == pid
        # relaunched from the v0 template, it was re-pushed v3 before counting as ready
        assert _version(url) == 3
        log = (tmp_path / f"engine-0-{url.rsplit(':', 1)[1]}.log").read_text()
        assert log.count("starting:") == 2
        # max_restarts = 1 is spent: the next death is final, with the reason
        pid2 = st["pid"]
        os.kill(pid2, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while ray.get(actor.alive.remote()) and time.monotonic() < deadline:
            time.sleep(0.1)
        st = ray.get(actor.status.remote())
        assert st["state"] == "failed" and st["launches"] == 2
        assert "max_restarts=1 exhausted" in st["error"] and "died" in st["error"]
        with pytest.raises(ray.exceptions.RayTaskError, match="max_restarts=1 exhausted"):
            ray.get(actor.wait_ready.remote(1.0))
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)


@pytest.mark.slow
def test_a_killed_actor_takes_its_server_with_it(ray_session, ckpts, tmp_path):
    ray = ray_session
    v0, _ = ckpts
    actor = ray.remote(SGLangEngineActor).options(max_concurrency=8).remote(
        RECIPE, 1, str(v0), 0, command=_embedded_command(v0), log_dir=str(tmp_path))
    ray.get(actor.start.remote())
    pid = ray.get(actor.pid.remote())
    ray.kill(actor)  # SIGKILL of the actor's worker process: no stop() runs
    assert _gone(pid), "the server outlived its actor"


def test_a_server_that_cannot_start_fails_once_with_its_log_tail(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('error: no GPU memory left', flush=True); "
             "sys.exit(3)"]
    actor = SGLangEngineActor(RECIPE, 0, "/unused", 0, command=crash, log_dir=str(tmp_path))
    with pytest.raises(EngineStartError) as err:
        actor.start()
    msg = str(err.value)
    assert "exited (code 3) before" in msg and "/health_generate" in msg
    assert "error: no GPU memory left" in msg  # the server's own words, from the log tail
    assert actor.state == "failed" and actor.launches == 1  # a failed first start is final


def test_a_server_that_never_answers_times_out_with_its_log_tail(tmp_path):
    sleeper = [sys.executable, "-c", "import time; print('loading weights', flush=True); "
               "time.sleep(60)"]
    actor = SGLangEngineActor(RECIPE, 0, "/unused", 0, command=sleeper, log_dir=str(tmp_path),
                              startup_timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as err:
        actor.start()
    assert time.monotonic() - t0 < 10
    assert "did not answer 200 within 2 s" in str(err.value)
    assert "loading weights" in str(err.value)
    assert actor.pid() is None  # the stuck process was stopped


def test_client_speaks_the_sglang_contract_to_an_actor_launched_server(ckpts, tmp_path):
    """generate with log-probs, routed experts (P + O − 1 − start rows), weight update from
    disk, pause/continue — through RolloutClient, as for SGLang; then stop() ends it by PID."""
    v0, v3 = ckpts
    actor = SGLangEngineActor(RECIPE, 0, str(v0), 0, command=_embedded_command(v0),
                              log_dir=str(tmp_path))
    url = actor.start()
    prompt = [1, *CharTokenizer().encode("12+3=")]

    async def run():
        async with RolloutClient([url], health_interval_s=0.2) as client:
            req = GenerateRequest(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                         seed=1),
                                  return_routed_experts=True, routed_experts_start_len=2)
            (res,) = await client.generate_one(req)
            assert len(res.output_ids) == 6 and len(res.output_logprobs) == 6
            assert all(lp <= 0.0 for lp in res.output_logprobs)
            assert res.routed_experts.shape == (len(prompt) + 6 - 1 - 2, LAYERS, TOP_K)
            assert res.routed_experts.dtype == np.int32 and res.weight_version == 0
            assert res.finish_reason == "length" and res.finish_detail["type"] == "length"
            (ok,) = await client.update_weights_from_disk(str(v3), 3)
            assert ok.success
            await client.pause_generation("in_place")
            held = asyncio.create_task(client.generate_one(GenerateRequest(
                prompt, SamplingParams(max_new_tokens=4, ignore_eos=True, seed=2))))
            await asyncio.sleep(0.5)
            assert not held.done()  # paused: the request waits
            await client.continue_generation()
            (after,) = await asyncio.wait_for(held, 30)
            assert after.weight_version == 3 and after.output_token_weight_versions == [3] * 4

    try:
        asyncio.run(run())
    finally:
        pid = actor.pid()
        actor.stop()
    assert _gone(pid, 5) and actor.state == "stopped" and not actor.alive()


@pytest.mark.slow
def test_fleet_places_starts_pushes_and_stops_its_engines(ray_session, ckpts, tmp_path):
    """The runtime's view: a placement group, one actor per engine, URLs, weights, stop."""
    from training.engines.sglang.fleet import SGLangFleet

    ray = ray_session
    v0, v3 = ckpts
    recipe = recipe_from_dict({**RECIPE, "engines": {**RECIPE["engines"],
                                                     "num_rollout_engines": 1}})
    fleet = SGLangFleet(recipe, v0, 0, log_dir=tmp_path, command=_embedded_command(v0),
                        gpus_per_engine=0)
    try:
        urls = fleet.start(ray)
        assert urls == fleet.engine_urls and len(urls) == 1 and fleet.alive(ray)
        (res,) = fleet.push_weights(ray, str(v3), 3)
        assert res["success"] and _version(urls[0]) == 3
        (st,) = fleet.statuses(ray)
        assert (st["weight_version"], st["weights_path"], st["state"]) == (3, str(v3), "ready")
        assert fleet.launches(ray) == 1
        pid = st["pid"]
    finally:
        fleet.stop(ray)
    assert _gone(pid, 10) and fleet.actors == []
