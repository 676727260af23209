"""The embedded rollout server over real HTTP: two server subprocesses (a dense bf16 one started
through `asyncrl engine serve`, an MoE fp32 one) on free ports, shared by the module (the
``servers`` and ``ckpts`` fixtures of this package's conftest)."""

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from training.engines.hf_io import load_hf_dir
from training.engines.ports import free_port
from training.engines.sampling import sampling_log_probs
from training.tasks.tokenizer import CharTokenizer

PROMPT = [1, *CharTokenizer().encode("3+4+1=")]
HTTP = httpx.Client(timeout=60)  # one pool: a fresh client per poll costs ~10-50 ms


def _gen(url, prompt=PROMPT, timeout=60, **kw):
    body = {"input_ids": prompt, "return_logprob": True, **kw}
    body.setdefault("sampling_params", {"max_new_tokens": 16})
    r = HTTP.post(url + "/generate", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _long(url, seed=0, n_tokens=200, **kw):
    return _gen(url, sampling_params={"max_new_tokens": n_tokens, "ignore_eos": True,
                                      "sampling_seed": seed}, **kw)


def _state(url):
    return HTTP.get(url + "/server_info").json()["internal_states"][0]


def _wait_running(url, new_tokens=5, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if HTTP.get(url + "/get_load").json()[0]["num_tokens"] >= len(PROMPT) + new_tokens:
            return
        time.sleep(0.005)
    raise AssertionError("request never started generating")


def _wait_idle(url, timeout=60):
    """Until the server holds no sequence (an earlier test's requests may still be finishing,
    and their tokens would count in ``/get_load``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if HTTP.get(url + "/get_load").json()[0]["num_tokens"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError("the server never became idle")


def _trainer(ckpt):
    return load_hf_dir(ckpt, torch.float32).model.eval()


def _trainer_logits(model, prompt, output):
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits, routes = model(ids)
    return logits[0, len(prompt) - 1:], routes


# ------------------------------------------------------------------------------------------------
# /generate
# ------------------------------------------------------------------------------------------------


def test_generate_answers_sglang_fields_with_logprobs(servers):
    out = _gen(servers["dense"], sampling_params={"max_new_tokens": 12, "sampling_seed": 1})
    meta = out["meta_info"]
    o = meta["completion_tokens"]
    assert 1 <= o <= 12 and len(out["output_ids"]) == o and meta["prompt_tokens"] == len(PROMPT)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 and txt is None for lp, _, txt in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "stop":
        assert out["output_ids"][-1] == meta["finish_reason"]["matched"] == 2  # eos
    assert meta["weight_version"] == "0" and meta["output_token_weight_versions"] == ["0"] * o
    assert out["text"] == CharTokenizer().decode(out["output_ids"])
    # a text prompt is tokenised with <bos> prepended
    by_text = _gen(servers["dense"], prompt=None, text="3+4+1=",
                   sampling_params={"max_new_tokens": 12, "sampling_seed": 1})
    assert by_text["output_ids"] == out["output_ids"]


def test_seeded_requests_are_reproducible(servers):
    params = {"max_new_tokens": 24, "sampling_seed": 5, "ignore_eos": True}
    a = _gen(servers["dense"], sampling_params=params)
    b = _gen(servers["dense"], sampling_params=params)
    c = _gen(servers["dense"], sampling_params={**params, "sampling_seed": 6})
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert a["output_ids"] != c["output_ids"]


def test_batch_and_n_answer_request_major_lists_equal_to_single_requests(servers):
    url = servers["moe"]  # fp32: batch composition cannot change the sampled tokens
    prompts = [PROMPT, PROMPT[:4]]
    params = {"max_new_tokens": 10, "n": 3, "sampling_seed": 40, "ignore_eos": True}
    outs = _gen(url, prompt=prompts, sampling_params=params, rid=["x", "y"])
    assert len(outs) == 6
    assert [o["meta_info"]["id"] for o in outs] == ["x-0", "x-1", "x-2", "y-0", "y-1", "y-2"]
    for i, prompt in enumerate(prompts):
        for j in range(3):
            single = _gen(url, prompt=prompt, sampling_params={
                "max_new_tokens": 10, "sampling_seed": 40 + j, "ignore_eos": True})
            assert outs[3 * i + j]["output_ids"] == single["output_ids"]
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1  # n samples differ
    one = _gen(url, sampling_params={"max_new_tokens": 4, "n": 2})
    assert isinstance(one, list) and len(one) == 2


def test_stop_strings_and_stop_token_ids(servers):
    url = servers["moe"]
    free = _gen(url, sampling_params={"max_new_tokens": 30, "sampling_seed": 3,
                                      "ignore_eos": True})
    ids = free["output_ids"]
    stop_id = ids[4]
    cut = _gen(url, sampling_params={"max_new_tokens": 30, "sampling_seed": 3, "ignore_eos": True,
                                     "stop_token_ids": [stop_id]})
    first = ids.index(stop_id)
    assert cut["output_ids"] == ids[:first + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    text = CharTokenizer().decode(ids)
    stop = text[6:8]
    by_str = _gen(url, sampling_params={"max_new_tokens": 30, "sampling_seed": 3,
                                        "ignore_eos": True, "stop": [stop]})
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert by_str["text"] == text[:text.index(stop)]


def test_concurrent_requests_join_one_running_batch(servers):
    url = servers["dense"]
    before = _state(url)

    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(url + "/generate", json={
                "input_ids": PROMPT, "sampling_params": {
                    "max_new_tokens": 32, "ignore_eos": True, "sampling_seed": i}})
                for i in range(8)))

    answers = asyncio.run(burst())
    assert all(a.status_code == 200 and a.json()["meta_info"]["completion_tokens"] == 32
               for a in answers)
    after = _state(url)
    steps = after["decode_steps"] - before["decode_steps"]
    assert after["generated_tokens"] - before["generated_tokens"] == 8 * 32
    assert steps < 2 * 32, f"8 x 32 tokens took {steps} decode steps: not batched"
    assert after["max_running_batch"] >= 4


def test_a_new_request_joins_and_leaves_while_a_long_one_runs(servers):
    url = servers["dense"]
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(_long, url, 1, 200)
        _wait_running(url)
        short = _gen(url, sampling_params={"max_new_tokens": 5, "ignore_eos": True})
        assert short["meta_info"]["completion_tokens"] == 5
        assert not long.done(), "the long request should still be decoding"
        assert long.result()["meta_info"]["completion_tokens"] == 200


def test_streaming_sends_sse_chunks_then_done(servers):
    with httpx.stream("POST", servers["dense"] + "/generate", json={
            "input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    # one chunk per token (cumulative), then the final answer
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 6


# ------------------------------------------------------------------------------------------------
# numerics
# ------------------------------------------------------------------------------------------------


def test_fp32_mode_matches_the_trainer_and_routes_match_the_fp32_model(servers, ckpts):
    out = _gen(servers["moe"], return_routed_experts=True, sampling_params={
        "max_new_tokens": 40, "sampling_seed": 2, "ignore_eos": True})
    ids, meta = out["output_ids"], out["meta_info"]
    p, o = len(PROMPT), len(ids)
    routes = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    routes = routes.reshape(p + o - 1, 2, 2)  # (P + O − 1, L, k)
    logits, trainer_routes = _trainer_logits(_trainer(ckpts["moe"]), PROMPT, ids)
    np.testing.assert_array_equal(routes, trainer_routes[0].numpy())
    trainer_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    served = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert (served - trainer_lp).abs().max().item() < 1e-5
    # routed_experts_start_len drops the first positions
    tail = _gen(servers["moe"], return_routed_experts=True, routed_experts_start_len=3,
                sampling_params={"max_new_tokens": 40, "sampling_seed": 2, "ignore_eos": True})
    tail_routes = np.frombuffer(base64.b64decode(tail["meta_info"]["routed_experts"]), np.int32)
    np.testing.assert_array_equal(tail_routes.reshape(-1, 2, 2), routes[3:])


def test_truncated_sampling_reports_the_renormalised_log_prob(servers, ckpts):
    params = {"max_new_tokens": 30, "sampling_seed": 9, "ignore_eos": True, "temperature": 0.7,
              "top_k": 5, "top_p": 0.8}
    out = _gen(servers["moe"], sampling_params=params)
    ids = out["output_ids"]
    logits, _ = _trainer_logits(_trainer(ckpts["moe"]), PROMPT, ids)
    n = len(ids)
    expected = sampling_log_probs(logits, torch.full((n,), 0.7), torch.full((n,), 0.8),
                                  torch.full((n,), 5))
    expected = expected.gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.isfinite(expected).all()  # every sampled token is inside the kept set
    served = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert (served - expected).abs().max().item() < 1e-5


def test_bf16_mode_differs_from_the_fp32_trainer_within_sane_bounds(servers, ckpts):
    model = _trainer(ckpts["dense"])
    diffs = []
    for seed in range(3):
        out = _gen(servers["dense"], sampling_params={"max_new_tokens": 48, "ignore_eos": True,
                                                      "sampling_seed": seed})
        logits, _ = _trainer_logits(model, PROMPT, out["output_ids"])
        lp = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(out["output_ids"])[:, None])[:, 0]
        served = torch.tensor([x for x, _, _ in out["meta_info"]["output_token_logprobs"]])
        diffs.append((served - lp).abs())
    d = torch.cat(diffs)
    assert d.mean().item() > 1e-4, "bf16 should not reproduce fp32 exactly"
    assert d.mean().item() < 0.05 and d.max().item() < 0.5


# ------------------------------------------------------------------------------------------------
# weights, pause, abort
# ------------------------------------------------------------------------------------------------


def _update(url, path, version=None):
    body = {"model_path": str(path)}
    if version is not None:
        body["weight_version"] = version
    return HTTP.post(url + "/update_weights_from_disk", json=body, timeout=30)


def test_weight_update_changes_outputs_and_a_bad_path_keeps_the_old_weights(servers, ckpts,
                                                                             tmp_path):
    url = servers["dense"]
    greedy = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    before = _gen(url, sampling_params=greedy)
    try:
        r = _update(url, ckpts["dense_b"], version="5")
        assert r.status_code == 200 and r.json()["success"] is True
        after = _gen(url, sampling_params=greedy)
        assert after["output_ids"] != before["output_ids"]
        assert after["meta_info"]["weight_version"] == "5"
        assert after["meta_info"]["output_token_weight_versions"] == ["5"] * 20
        assert HTTP.get(url + "/model_info").json()["weight_version"] == "5"
        (tmp_path / "empty").mkdir()
        for bad in (tmp_path / "missing", tmp_path / "empty"):
            r = _update(url, bad, version="6")
            body = r.json()
            assert r.status_code == 400 and body["success"] is False
            assert str(bad) in body["message"] and "still serving weight_version 5" in \
                body["message"]
        again = _gen(url, sampling_params=greedy)
        assert again["output_ids"] == after["output_ids"]
        assert again["meta_info"]["weight_version"] == "5"
    finally:
        r = _update(url, ckpts["dense"])  # version from the checkpoint's asyncrl.json: 0
        assert r.json()["success"] is True
    assert _gen(url, sampling_params=greedy)["output_ids"] == before["output_ids"]


def test_pause_in_place_holds_requests_and_an_update_while_paused_shows_per_token(servers,
                                                                                   ckpts):
    url = servers["dense"]
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_long, url, 3, 200)
            _wait_running(url)
            assert HTTP.post(url + "/pause_generation", json={"mode": "in_place"}).status_code \
                == 200
            held = _state(url)
            assert held["paused"] == "in_place" and held["running"] == 1
            time.sleep(0.3)
            assert _state(url)["generated_tokens"] == held["generated_tokens"]  # no steps
            assert not fut.done()
            assert _update(url, ckpts["dense_b"], version="7").json()["success"] is True
            HTTP.post(url + "/continue_generation", json={})
            out = fut.result(timeout=60)
    finally:
        HTTP.post(url + "/continue_generation", json={})
        _update(url, ckpts["dense"])
    meta = out["meta_info"]
    versions = meta["output_token_weight_versions"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 200
    assert meta["weight_version"] == "7" and versions[0] == "0" and versions[-1] == "7"
    switch = versions.index("7")  # old-version tokens, then new-version tokens
    assert set(versions[:switch]) == {"0"} and set(versions[switch:]) == {"7"}


def test_pause_abort_returns_partial_output_and_queues_new_requests(servers):
    url = servers["dense"]
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(_long, url, 4, 200)
        _wait_running(url)
        assert HTTP.post(url + "/pause_generation", json={"mode": "abort"}).status_code == 200
        out = fut.result(timeout=30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < out["meta_info"]["completion_tokens"] < 200
        lps = out["meta_info"]["output_token_logprobs"]
        assert len(lps) == out["meta_info"]["completion_tokens"]
        waiting = pool.submit(_gen, url)  # queued while paused
        time.sleep(0.3)
        assert not waiting.done() and _state(url)["waiting"] == 1
        HTTP.post(url + "/continue_generation", json={})
        assert waiting.result(timeout=30)["meta_info"]["finish_reason"]["type"] != "abort"


def test_abort_request_by_rid_returns_partial_output(servers):
    url = servers["dense"]
    _wait_idle(url)  # so that the load _wait_running sees is the victim's own
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_long, url, 5, 200, rid="victim")
        _wait_running(url)
        r = HTTP.post(url + "/abort_request", json={"rid": "victim"})
        assert r.status_code == 200 and r.json()["aborted"] == 1
        out = fut.result(timeout=30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["id"] == "victim"
    assert 0 < out["meta_info"]["completion_tokens"] < 200


def _routes(out):
    raw = base64.b64decode(out["meta_info"]["routed_experts"])
    return np.frombuffer(raw, dtype=np.int32).reshape(-1, 2, 2)


def test_abort_returns_routes_of_the_computed_positions_only(servers):
    """Routes cover every position whose next token was computed: P + O − 1 for a running
    request; none for a request aborted while queued (never prefilled) → (0, L, k)."""
    url = servers["moe"]
    kw = dict(return_routed_experts=True)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(_long, url, 9, 300, rid="ran", **kw)
            _wait_running(url)
            HTTP.post(url + "/pause_generation", json={"mode": "in_place"})
            queued = pool.submit(_long, url, 9, 300, rid="queued", **kw)
            deadline = time.monotonic() + 30
            while _state(url)["waiting"] < 1:
                assert time.monotonic() < deadline, "request never queued"
                time.sleep(0.01)
            assert HTTP.post(url + "/abort_request", json={"abort_all": True}).json()[
                "aborted"] == 2
            ran, never = running.result(timeout=30), queued.result(timeout=30)
    finally:
        HTTP.post(url + "/continue_generation", json={})
    assert ran["meta_info"]["finish_reason"]["type"] == "abort"
    assert _routes(ran).shape == (len(PROMPT) + ran["meta_info"]["completion_tokens"] - 1, 2, 2)
    assert never["meta_info"]["finish_reason"]["type"] == "abort"
    assert never["output_ids"] == [] and _routes(never).shape == (0, 2, 2)


def test_retract_then_continue_reproduces_the_uninterrupted_fp32_run(servers):
    url = servers["moe"]
    kw = dict(return_routed_experts=True)
    reference = _long(url, seed=8, n_tokens=150, **kw)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_long, url, 8, 150, **kw)
        _wait_running(url, new_tokens=20)
        HTTP.post(url + "/pause_generation", json={"mode": "retract"})
        state = _state(url)
        assert state["running"] == 0 and state["waiting"] == 1  # cache freed, re-queued
        HTTP.post(url + "/continue_generation", json={})
        out = fut.result(timeout=60)
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["routed_experts"] == reference["meta_info"]["routed_experts"]
    np.testing.assert_allclose([x[0] for x in out["meta_info"]["output_token_logprobs"]],
                               [x[0] for x in reference["meta_info"]["output_token_logprobs"]],
                               atol=1e-5)
    assert _state(url)["retractions"] >= 1


# ------------------------------------------------------------------------------------------------
# info endpoints, errors, CLI
# ------------------------------------------------------------------------------------------------


def test_health_and_info_endpoints(servers):
    url = servers["moe"]
    assert HTTP.get(url + "/health").status_code == 200
    assert HTTP.get(url + "/health_generate", timeout=30).status_code == 200
    info = HTTP.get(url + "/model_info").json()
    assert info == HTTP.get(url + "/get_model_info").json()
    assert info["is_generation"] and info["num_hidden_layers"] == 2
    assert info["num_experts_per_tok"] == 2 and info["architectures"] == ["MixtralForCausalLM"]
    server = HTTP.get(url + "/server_info").json()
    assert server["dtype"] == "fp32" and "max_running_batch" in server["internal_states"][0]
    models = HTTP.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == "moe"
    load = HTTP.get(url + "/get_load").json()
    assert load[0]["dp_rank"] == 0 and load[0]["num_tokens"] == 0
    assert HTTP.post(url + "/flush_cache").status_code == 200
    assert HTTP.get(url + "/flush_cache").status_code == 200


@pytest.mark.parametrize("body, words", [
    ({"input_ids": [1, 500]}, "input_ids"),
    ({"input_ids": [1, 5], "sampling_params": 5}, "sampling_params must be a JSON object"),
    ({"text": 5}, "text must be a string"),
    ({"text": ["ab", 3]}, "text must be a string"),
    ({"input_ids": [1, 5], "sampling_params": {"stop_token_ids": 5}}, "stop_token_ids"),
    ({"input_ids": [1, 5], "sampling_params": {"stop": [5]}}, "stop must be"),
    ({"input_ids": [1, 5], "sampling_params": {"ignore_eos": "no"}}, "ignore_eos"),
    ({"input_ids": [1, 5], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
    ({"input_ids": [1, 5], "routed_experts_start_len": "abc"}, "routed_experts_start_len"),
    ({"input_ids": [1, 5], "routed_experts_start_len": -2}, "routed_experts_start_len"),
    ({"input_ids": [1, 5], "routed_experts_start_len": 1.5}, "routed_experts_start_len"),
    ({"input_ids": 5}, "input_ids must be a list"),
    ({"input_ids": {"a": 1}}, "input_ids must be a list"),
    ({"input_ids": [[1, 5], 3]}, "input_ids[1]"),
    ({"input_ids": [[1, 5], []]}, "input_ids[1]"),
    ({"input_ids": [1, None]}, "input_ids holds None"),
    ({"input_ids": [1, True]}, "input_ids holds True"),
    ({"input_ids": [[1, 5], [1, 6]], "sampling_params": [{}, {"top_k": "x"}]}, "top_k"),
    ({"input_ids": [[1, 5], [1, 6]], "sampling_params": [{}]}, "sampling_params has 1"),
    ({"input_ids": [1, 5], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1, 5], "rid": {"a": 1}}, "rid must be a string"),
    ({"input_ids": [1, 5], "stream": "yes"}, "stream must be true or false"),
    ([1, 5], "JSON object"),
    ("hello", "JSON object"),
    ({"input_ids": [1, 5], "sampling_params": {"repetition_penalty": 1.3}},
     "repetition_penalty"),
    ({"input_ids": [1, 5], "return_routed_experts": True}, "dense"),
    ({"input_ids": [1] * 512}, "context length"),
    ({"sampling_params": {}}, "input_ids or text"),
    ({"input_ids": [1], "stream": True, "sampling_params": {"n": 2}}, "stream"),
])
def test_bad_requests_are_400_with_a_reason(servers, body, words):
    before = _state(servers["dense"])["requests_finished"]
    r = HTTP.post(servers["dense"] + "/generate", json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert words in message and "\n" not in message
    assert _state(servers["dense"])["requests_finished"] == before  # nothing was queued


@pytest.mark.parametrize("raw, words", [
    (b'{"input_ids": [1, 5], "sampling_params": {"max_new_tokens": Infinity}}',
     "max_new_tokens"),
    (b'{"input_ids": [1, 5], "sampling_params": {"temperature": NaN}}', "temperature"),
    (b'{"input_ids": [1, 5]', "not valid JSON"),
    (b'\xff\xfe{}', "not valid JSON"),
])
def test_bodies_that_are_not_plain_json_are_400(servers, raw, words):
    r = HTTP.post(servers["dense"] + "/generate", content=raw,
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.slow
def test_cli_announces_once_listening_and_a_port_in_use_fails_in_one_line(ckpts):
    port = str(free_port())
    serve = [sys.executable, "-m", "ui.cli", "engine", "serve", "--checkpoint",
             str(ckpts["dense"]), "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([*serve, "--port", port], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = first.stderr.readline()
        assert line.startswith("asyncrl engine: serving ") and f":{port}" in line, line
        # printed only once listening: the server answers the moment the line is out
        assert HTTP.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        for extra, message in [
            (["--port", port], f"error: port {port} is in use on 127.0.0.1; pick another "
                               "--port (or stop the process listening there)"),
            (["--port", port, "--host", "no-such-host.invalid"],
             "error: --host 'no-such-host.invalid' is not an IP address or resolvable name"),
        ]:
            res = subprocess.run([*serve, *extra], capture_output=True, text=True, timeout=120,
                                 env=env)
            assert res.returncode == 1, res.stderr
            assert res.stderr.startswith(message) and res.stderr.count("\n") == 1, res.stderr
            assert "Traceback" not in res.stderr and "serving" not in res.stderr
            assert res.stdout == ""
    finally:
        first.terminate()
        try:
            first.wait(10)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait(10)


def test_cli_rejects_a_bad_checkpoint_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from ui.cli import app

    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(app, ["engine", "serve", "--checkpoint", str(tmp_path / "empty"),
                                   "--port", "1"])
    assert res.exit_code == 1
    assert res.output.strip().count("\n") == 0 and "is empty" in res.output
    assert res.output.startswith("error: ")


@pytest.mark.slow
def test_server_exits_when_the_process_that_started_it_is_killed(ckpts, tmp_path):
    """kill -9 of a run must not leave its engine servers behind (they watch their parent)."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\n"
        "from training.engines.embedded.launch import EmbeddedServer\n"
        f"s = EmbeddedServer({str(ckpts['dense'])!r}).start().wait_ready(60)\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(driver.stdout.readline())
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(server_pid, signal.SIGKILL)
            raise AssertionError("the server outlived the killed driver")
    finally:
        if driver.poll() is None:
            driver.kill()
