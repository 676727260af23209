"""The rollout client + router against real embedded servers: load balancing, a server killed
mid-run (no request lost), ejection, re-admission with a weight resync, routed experts carried."""

import asyncio
import time

import httpx
import numpy as np
import pytest

from training.engines.client import (
    NoHealthyEngineError,
    RolloutClient,
    SyncRolloutClient,
    _estimate_tokens,
)
from training.engines.embedded.launch import EmbeddedServer, start_all
from training.engines.hf_io import save_hf_dir
from training.engines.model import CausalLM, ModelConfig
from training.engines.ports import free_port
from training.engines.rollout import EngineRequestError, GenerateRequest, SamplingParams
from training.tasks.tokenizer import CharTokenizer

PROMPT = [1, *CharTokenizer().encode("2+2=")]


def _checkpoint(path, seed=0, version=0):
    cfg = ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=2, intermediate_size=48,
                      max_position_embeddings=256, num_experts=4, num_experts_per_tok=2)
    return save_hf_dir(path, CausalLM(cfg).init_weights(seed, std=0.15), CharTokenizer(),
                       weight_version=version)


@pytest.fixture
def fleet(tmp_path):
    a, b = (EmbeddedServer(_checkpoint(tmp_path / "ckpt"), dtype="fp32", max_batch=32,
                           log_path=tmp_path / f"{name}.log") for name in "ab")
    start_all([a, b])
    yield a, b
    a.stop()
    b.stop()


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def _until(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not (await predicate() if asyncio.iscoroutinefunction(predicate) else predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(what() if callable(what) else what)
        await asyncio.sleep(0.01)


@pytest.mark.slow
def test_router_survives_a_killed_engine_and_readmits_it_with_current_weights(fleet, tmp_path):
    a, b = fleet
    update = _checkpoint(tmp_path / "v3", seed=1)
    reqs = [GenerateRequest(PROMPT, SamplingParams(max_new_tokens=48, ignore_eos=True, seed=i),
                            return_routed_experts=True) for i in range(40)]

    async def run():
        async with RolloutClient([a.url, b.url], health_interval_s=0.2) as client:
            results = await client.update_weights_from_disk(str(update), 3)
            assert [r.success for r in results] == [True, True]
            task = asyncio.create_task(client.generate(reqs))
            # kill A while it is decoding requests
            async with httpx.AsyncClient() as http:
                async def a_busy():
                    load = (await http.get(a.url + "/get_load")).json()[0]["num_tokens"]
                    return load >= 100 and client.engines[a.url].in_flight > 0

                await _until(a_busy, "A never got busy")
            a.kill()
            answers = await asyncio.wait_for(task, 60)
            after_kill = client.stats()
            a.start()
            await _until(lambda: client.stats().readmissions > 0,
                         lambda: f"A not re-admitted: {client.stats()}\n{a.log_tail()}")
            again = await asyncio.wait_for(client.generate(reqs[:8]), 60)
            return answers, after_kill, client.stats(), again

    answers, after_kill, final, again = asyncio.run(run())
    # no request lost: every one completed in full, routed experts carried through the router
    assert len(answers) == 40
    for [r] in answers:
        assert r.finish_reason == "length" and r.completion_tokens == 48
        assert r.weight_version == 3 and r.engine_url in (a.url, b.url)
        assert r.routed_experts.shape == (len(PROMPT) + 48 - 1, 2, 2)
        assert r.routed_experts.dtype == np.int32
    assert after_kill.retries >= 1 and after_kill.failed_attempts >= 1 and after_kill.lost == 0
    assert after_kill.ejections == 1 and not after_kill.engines[a.url]["admitted"]
    assert after_kill.engines[a.url]["requests"] > 0 and after_kill.engines[b.url]["requests"] > 0
    assert after_kill.completed == 40
    # re-admitted after restart, with the router's weights (the checkpoint alone says v0)
    assert final.readmissions == 1 and final.resyncs == 1 and final.engines[a.url]["admitted"]
    assert httpx.get(a.url + "/model_info").json()["weight_version"] == "3"
    assert {r.engine_url for [r] in again} == {a.url, b.url}
    assert all(r.weight_version == 3 for [r] in again)


def test_sync_client_balances_by_outstanding_tokens_and_fans_out(fleet):
    a, b = fleet
    with SyncRolloutClient([a.url, b.url], health_interval_s=0.2) as client:
        reqs = [GenerateRequest(PROMPT, SamplingParams(max_new_tokens=16, n=2, seed=i))
                for i in range(10)]
        results = client.generate(reqs)
        assert [len(r) for r in results] == [2] * 10
        stats = client.stats()
        assert stats.requests == stats.completed == 10 and stats.retries == 0
        sent = [stats.engines[u]["requests"] for u in (a.url, b.url)]
        assert sent[0] >= 3 and sent[1] >= 3, f"unbalanced: {sent}"
        assert all(e["in_flight"] == 0 and e["outstanding_tokens"] == 0
                   for e in stats.engines.values())
        assert client.health() and client.health_all() == {a.url: True, b.url: True}
        assert client.model_info().moe_layout == (2, 2)
        client.pause_generation("in_place")
        assert all(httpx.get(u + "/server_info").json()["internal_states"][0]["paused"]
                   == "in_place" for u in (a.url, b.url))
        client.continue_generation()
        client.abort()
        client.flush_cache()
        with pytest.raises(EngineRequestError, match="HTTP 400"):
            client.generate([GenerateRequest([1, 999])])  # out-of-vocab id: not retried
        assert client.stats().retries == 0


@pytest.mark.slow
def test_health_checks_eject_and_readmit_without_traffic(tmp_path):
    srv = EmbeddedServer(_checkpoint(tmp_path / "ckpt"), dtype="fp32",
                         log_path=tmp_path / "s.log")
    start_all([srv])
    try:
        with SyncRolloutClient([srv.url], health_interval_s=0.1) as client:
            srv.kill()
            _wait(lambda: client.stats().ejections == 1)
            srv.start()
            _wait(lambda: client.stats().readmissions == 1)
            assert client.generate([GenerateRequest(PROMPT)])[0][0].completion_tokens >= 1
            assert client.stats().resyncs == 0  # nothing pushed: nothing to resync
    finally:
        srv.stop()


def test_no_engine_answers_raises_after_the_wait():
    dead = f"http://127.0.0.1:{free_port()}"
    with SyncRolloutClient([dead], wait_for_engine_s=0.5, health_interval_s=0.1) as client:
        with pytest.raises(NoHealthyEngineError, match="no healthy rollout engine"):
            client.generate([GenerateRequest(PROMPT)])
        s = client.stats()
        assert s.requests == s.lost == 1 and s.ejections == 1
        assert not client.health()


@pytest.mark.parametrize("payload", [
    {"sampling_params": 5}, {"input_ids": [1, 5], "sampling_params": [5, None]}, {"text": 5},
    {"input_ids": 7}, {"input_ids": [[1, 2], 3], "sampling_params": {"max_new_tokens": "x"}},
    {"input_ids": [1], "sampling_params": {"n": True, "max_new_tokens": -4}}, {},
])
def test_token_estimate_of_a_malformed_body_never_raises(payload):
    assert _estimate_tokens(payload) >= 0
    assert _estimate_tokens({"input_ids": [[1, 2], [1]], "sampling_params": {"n": 2}}) == \
        3 + 2 * 128 * 2


MALFORMED = [
    {"input_ids": PROMPT, "sampling_params": 5},
    {"text": 5},
    {"input_ids": PROMPT, "sampling_params": {"stop_token_ids": 5}},
    {"input_ids": PROMPT, "routed_experts_start_len": "abc"},
    {"input_ids": PROMPT, "routed_experts_start_len": -2},
    {"input_ids": [[1, 2], 3]},
]


def test_malformed_requests_are_rejected_once_without_retry_or_ejection(fleet):
    a, b = fleet
    with SyncRolloutClient([a.url, b.url], health_interval_s=0.2, failures_to_eject=1) as client:
        for payload in MALFORMED:
            with pytest.raises(EngineRequestError, match="HTTP 400") as err:
                client.generate_raw(payload)
            assert "\n" not in str(err.value)
        with pytest.raises(EngineRequestError, match="input_ids holds 999"):
            client.generate([GenerateRequest([1, 999], return_routed_experts=True)])
        ok = client.generate([GenerateRequest(PROMPT, SamplingParams(max_new_tokens=4))])
        assert ok[0][0].completion_tokens >= 1
        with pytest.raises(TypeError, match="payload must be a dict"):
            client.generate_raw([PROMPT])  # a caller bug: nothing sent, nothing counted
        s = client.stats()
    bad = len(MALFORMED) + 1
    assert s.requests == bad + 1 and s.rejected == bad and s.completed == 1
    assert s.requests == s.completed + s.rejected + s.lost + s.cancelled
    assert s.retries == 0 and s.failed_attempts == 0 and s.lost == 0 and s.ejections == 0
    assert all(e["admitted"] and e["failures"] == 0 for e in s.engines.values())
    assert sum(e["rejected"] for e in s.engines.values()) == bad
    assert all(e["in_flight"] == 0 and e["outstanding_tokens"] == 0
               for e in s.engines.values())


@pytest.mark.parametrize("resync", [True, False])
def test_a_router_url_is_readmitted_without_an_engine_resync(resync):
    """A router (sglang-router) answers /health but has no /continue_generation: with
    ``resync=False`` it comes back as soon as it is healthy again; an engine-style resync would
    keep it out."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = {"healthy": True, "posts": []}

    class Router(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if state["healthy"] and self.path == "/health" else 503)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_POST(self):
            state["posts"].append(self.path)
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with SyncRolloutClient([url], health_interval_s=0.05, resync=resync) as client:
            state["healthy"] = False
            _wait(lambda: client.stats().ejections == 1)
            state["healthy"] = True
            if resync:
                time.sleep(0.5)
                assert client.stats().readmissions == 0
                assert "/continue_generation" in state["posts"]
            else:
                _wait(lambda: client.stats().readmissions == 1)
                assert state["posts"] == []
    finally:
        server.shutdown()
        server.server_close()
