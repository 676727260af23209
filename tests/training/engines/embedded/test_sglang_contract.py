"""The embedded server against SGLang 0.5.23's own request bodies (a contract test).

Every body here is one SGLang's code sends, field for field: its weight-version test
(``test/srt/test_weight_version.py``: ``/update_weights_from_disk`` with ``load_format`` and a
string ``weight_version``, ``/update_weight_version``, ``/get_weight_version``), the full
``UpdateWeightFromDiskReqInput`` / ``UpdateWeightsFromDistributedReqInput`` dataclasses of
``sglang.srt.managers.io_struct``, ``sglang.bench_serving``'s ``/generate`` request (``text``,
streaming, ``lora_path: null``, ``logprob_start_len: -1``) read as bench_serving reads it, and the
body ``sglang-router`` 0.3.2 rewrites a request into (captured from the real router: ``model:
null``, ``log_metrics``, ``return_hidden_states`` … added, ``return_routed_experts`` dropped) —
sent directly and through the real router. Versions go both ways as opaque strings, ordered by
load; asyncrl's own client still gets the integer versions it names. Wrong types answer HTTP 400
with one line naming the field. The servers are the package's ``servers`` fixture (conftest).
"""

import base64
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from training.engines.client import SyncRolloutClient
from training.engines.embedded.launch import EmbeddedServer
from training.engines.hf_io import META_FILE
from training.engines.ports import free_port
from training.engines.rollout import GenerateRequest, RolloutEngineError, SamplingParams
from training.tasks.tokenizer import CharTokenizer

TOK = CharTokenizer()
HTTP = httpx.Client(timeout=60)
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def _post(url, path, body):
    return HTTP.post(url + path, json=body)


def _generate(url, body):
    r = _post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def _load(url, path, version):
    """SGLang's own weight-version test body (test_weight_version.py)."""
    r = _post(url, "/update_weights_from_disk", {
        "model_path": str(path), "load_format": "auto", "abort_all_requests": False,
        "weight_version": version})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    return r.json()


def _served_versions(url):
    return {"get_weight_version": HTTP.get(url + "/get_weight_version").json()["weight_version"],
            **{p: HTTP.get(url + p).json()["weight_version"] for p in (
                "/model_info", "/get_model_info", "/server_info", "/get_server_info")},
            "internal_states": HTTP.get(url + "/server_info").json()["internal_states"][0][
                "weight_version"]}


@pytest.fixture
def dense(servers, ckpts):
    """The dense server; afterwards back on its starting weights, labelled "0" as at start."""
    yield servers["dense"]
    _load(servers["dense"], ckpts["dense"], "0")


# ------------------------------------------------------------------------------------------------
# weight versions: strings on the wire, ordered by load
# ------------------------------------------------------------------------------------------------


def test_a_string_weight_version_is_served_back_everywhere(dense, ckpts):
    plain = {"text": "Hello, how are you?", "sampling_params": {"temperature": 0.0,
                                                                "max_new_tokens": 5}}
    assert set(_served_versions(dense).values()) == {"0"}  # the checkpoint's asyncrl.json
    before = _generate(dense, plain)
    assert before["meta_info"]["weight_version"] == "0"

    answer = _load(dense, ckpts["dense_b"], "v7")
    assert answer["num_paused_requests"] == 0 and "v7" in answer["message"]
    assert set(_served_versions(dense).values()) == {"v7"}
    after = _generate(dense, {**plain, "return_logprob": True})
    meta = after["meta_info"]
    assert meta["weight_version"] == "v7"
    assert meta["output_token_weight_versions"] == ["v7"] * 5
    assert after["output_ids"] != before["output_ids"]  # the new weights answer
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == after["output_ids"] and len(lps) == 5
    assert all(isinstance(lp, float) and lp <= 0 and text is None for lp, _, text in lps)

    # /update_weight_version relabels the same weights (SGLang's body)
    r = _post(dense, "/update_weight_version", {"new_version": "updated_version_2.0",
                                                "abort_all_requests": False})
    assert r.status_code == 200 and r.json()["success"] is True
    assert r.json()["new_version"] == "updated_version_2.0"
    relabelled = _generate(dense, plain)
    assert relabelled["meta_info"]["weight_version"] == "updated_version_2.0"
    assert relabelled["output_ids"] == after["output_ids"]
    assert set(_served_versions(dense).values()) == {"updated_version_2.0"}


def test_full_io_struct_bodies_and_a_load_that_names_no_version(dense, ckpts, tmp_path):
    # every field of UpdateWeightFromDiskReqInput (BaseReq's rid / http_worker_ipc included)
    full = {"rid": None, "http_worker_ipc": None, "model_path": str(ckpts["dense_b"]),
            "load_format": None, "abort_all_requests": False, "weight_version": "v7",
            "is_async": False, "torch_empty_cache": False, "keep_pause": False,
            "recapture_cuda_graph": False, "token_step": 3, "flush_cache": True,
            "manifest": None}
    r = _post(dense, "/update_weights_from_disk", full)
    assert r.status_code == 200 and r.json() == {
        "success": True, "num_paused_requests": 0,
        "message": f"loaded {ckpts['dense_b'].resolve()} as weight_version v7"}
    # no weight_version and a checkpoint without asyncrl.json: the label stays (SGLang)
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ckpts["dense"].iterdir():
        if f.name != META_FILE:
            (bare / f.name).write_bytes(f.read_bytes())
    r = _post(dense, "/update_weights_from_disk", {"model_path": str(bare)})
    assert r.status_code == 200 and r.json()["success"] is True
    assert set(_served_versions(dense).values()) == {"v7"}
    # an asyncrl checkpoint names its own version ("0")
    _post(dense, "/update_weights_from_disk", {"model_path": str(ckpts["dense_b"])})
    assert set(_served_versions(dense).values()) == {"0"}


def test_versions_of_a_request_spanning_loads_are_in_load_order_not_label_order(dense, ckpts):
    """"zeta" is loaded before "alpha": the tokens say so, whatever the labels sort like."""
    _load(dense, ckpts["dense_b"], "zeta")
    body = {"text": "3+4+1=", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True,
                                                  "sampling_seed": 3}}
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_generate, dense, body)
            deadline = time.monotonic() + 30
            while HTTP.get(dense + "/get_load").json()[0]["num_tokens"] < 20:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.005)
            assert _post(dense, "/pause_generation", {"mode": "in_place"}).json()["status"] \
                == "ok"
            _load(dense, ckpts["dense"], "alpha")
            _post(dense, "/continue_generation", {"torch_empty_cache": True})
            out = fut.result(timeout=60)
    finally:
        _post(dense, "/continue_generation", {})
    versions = out["meta_info"]["output_token_weight_versions"]
    switch = versions.index("alpha")
    assert 0 < switch < 300 and versions == ["zeta"] * switch + ["alpha"] * (300 - switch)
    assert out["meta_info"]["weight_version"] == "alpha"  # the last token's, as SGLang


def test_a_server_whose_checkpoint_names_no_version_starts_as_default(ckpts, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ckpts["dense"].iterdir():
        if f.name != META_FILE:
            (bare / f.name).write_bytes(f.read_bytes())
    with EmbeddedServer(bare, dtype="fp32", log_path=tmp_path / "s.log") as server:
        assert set(_served_versions(server.url).values()) == {"default"}
        out = _generate(server.url, {"text": "1+2=", "sampling_params": GREEDY})
        assert out["meta_info"]["weight_version"] == "default"


def test_a_distributed_update_with_a_string_version(dense):
    """UpdateWeightsFromDistributedReqInput in full, inside a session, over gloo; the test
    process is the trainer (rank 0) that broadcasts."""
    import torch.distributed as dist

    from training.engines.sglang.nccl_sync import new_weight_group

    port, name = free_port(), "contract-weights"
    greedy = {"text": "12+34=", "sampling_params": GREEDY}
    before = _generate(dense, greedy)
    with ThreadPoolExecutor(2) as pool:
        join = pool.submit(_post, dense, "/init_weights_update_group", {
            "rid": None, "master_address": "127.0.0.1", "master_port": port,
            "rank_offset": 1, "world_size": 2, "group_name": name, "backend": "gloo"})
        group = new_weight_group("127.0.0.1", port, 0, 2, group_name=name, backend="gloo",
                                 timeout_s=60)
        try:
            assert join.result(60).json()["success"] is True
            assert _post(dense, "/begin_weight_update", {"selector": "all"}).json()["success"]
            norm = torch.randn(64, generator=torch.Generator().manual_seed(0))
            update = pool.submit(_post, dense, "/update_weights_from_distributed", {
                "rid": None, "names": ["model.norm.weight"], "dtypes": ["float32"],
                "shapes": [[64]], "group_name": name, "flush_cache": True,
                "abort_all_requests": False, "weight_version": "v8", "load_format": None,
                "torch_empty_cache": False})
            dist.broadcast(norm, src=0, group=group)
            r = update.result(60)
            assert r.status_code == 200 and r.json()["success"] is True, r.text
        finally:
            _post(dense, "/end_weight_update", {})
            dist.destroy_process_group(group)
    assert set(_served_versions(dense).values()) == {"v8"}
    after = _generate(dense, greedy)
    assert after["meta_info"]["weight_version"] == "v8"
    assert after["output_ids"] != before["output_ids"]  # the broadcast norm is served


def test_asyncrl_client_names_integer_versions_and_refuses_foreign_labels(dense, ckpts):
    """The runtime's side: versions it loads come back as the ints it named; "default" is the
    starting weights; a label asyncrl did not give is an error, never a guessed number."""
    req = GenerateRequest(TOK.encode("3+4=", add_bos=True),
                          SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    with SyncRolloutClient([dense]) as client:
        assert client.model_info().weight_version == 0
        assert all(r.success for r in client.update_weights_from_disk(str(ckpts["dense_b"]), 7))
        assert HTTP.get(dense + "/get_weight_version").json() == {"weight_version": "7"}
        [[res]] = client.generate([req])
        assert res.weight_version == 7 and res.output_token_weight_versions == [7] * 4
        _post(dense, "/update_weight_version", {"new_version": "default"})
        assert client.model_info().weight_version == 0
        _post(dense, "/update_weight_version", {"new_version": "v7"})
        with pytest.raises(RolloutEngineError, match="'v7', a label asyncrl did not give"):
            client.generate([req])


# ------------------------------------------------------------------------------------------------
# /generate bodies as SGLang's clients send them
# ------------------------------------------------------------------------------------------------


def test_bench_serving_streams_text_and_counts_completion_tokens(servers):
    """sglang.bench_serving's async_request_sglang_generate, parsed the way it parses."""
    payload = {"text": "3+4+1=", "sampling_params": {"temperature": 0.0, "max_new_tokens": 24,
                                                     "ignore_eos": True},
               "stream": True, "lora_path": None, "return_logprob": False,
               "logprob_start_len": -1}
    chunks, generated, output_len, done = [], "", 0, False
    with HTTP.stream("POST", servers["dense"] + "/generate", json=payload) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            line = line.strip()
            if not line:
                continue
            chunk = line.removeprefix("data: ")
            if chunk == "[DONE]":
                done = True
                continue
            data = json.loads(chunk)  # one JSON body per line
            chunks.append(data)
            if data["text"]:
                generated, output_len = data["text"], data["meta_info"]["completion_tokens"]
    assert done and output_len == 24 and len(chunks) >= 24
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and chunks[-1]["meta_info"]["finish_reason"]["type"] \
        == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert generated == chunks[-1]["text"] and chunks[-1]["meta_info"]["weight_version"] == "0"
    # the same request unstreamed gives the same text (greedy)
    assert _generate(servers["dense"], {**payload, "stream": False})["text"] == generated


ROUTER_BODY = {  # what sglang-router 0.3.2 sends a worker for a /generate (captured)
    "text": "3+4+1=", "model": None,
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
    "return_logprob": True, "logprob_start_len": -1, "return_text_in_logprobs": False,
    "stream": False, "log_metrics": True, "return_hidden_states": False, "background": False,
    "no_logs": False, "return_bytes": False, "return_entropy": False, "rid": "req-1"}


def test_the_router_rewritten_body_and_other_sglang_fields_are_accepted(servers):
    url = servers["dense"]
    out = _generate(url, ROUTER_BODY)
    meta = out["meta_info"]
    assert meta["id"] == "req-1" and meta["completion_tokens"] == 8
    assert len(meta["output_token_logprobs"]) == 8 and meta["weight_version"] == "0"
    # SGLang fields that change nothing here, at any value, and fields SGLang does not know
    busy = {**ROUTER_BODY, "rid": "req-2", "priority": 5, "custom_labels": {"team": "rl"},
            "routed_dp_rank": 0, "data_parallel_rank": 0, "bootstrap_host": None,
            "bootstrap_room": 7, "extra_key": "k", "cache_salt": "s", "conversation_id": "c",
            "session_id": "sess", "routing_key": "r", "external_trace_header": {"a": "b"},
            "top_logprobs_num": 0, "token_ids_logprob": None, "image_data": [],
            "lora_path": [None], "return_prompt_token_ids": False, "future_sglang_field": [1]}
    again = _generate(url, busy)
    assert again["output_ids"] == out["output_ids"] and again["meta_info"]["id"] == "req-2"
    assert [x[:2] for x in again["meta_info"]["output_token_logprobs"]] == \
        [x[:2] for x in meta["output_token_logprobs"]]


def test_return_text_in_logprobs_and_a_batch_rid_prefix(servers):
    url = servers["dense"]
    out = _generate(url, {**ROUTER_BODY, "return_text_in_logprobs": True})
    ids = out["output_ids"]
    assert [text for _, _, text in out["meta_info"]["output_token_logprobs"]] == \
        [TOK.decode([t], skip_special_tokens=False) for t in ids]
    batch = _generate(url, {"text": ["3+4=", "1+2="], "rid": "job",
                            "sampling_params": GREEDY, "return_logprob": [True, False]})
    assert [b["meta_info"]["id"] for b in batch] == ["job_0", "job_1"]  # SGLang's prefix rule
    assert "output_token_logprobs" in batch[0]["meta_info"]
    assert "output_token_logprobs" not in batch[1]["meta_info"]


def test_routed_experts_with_a_start_inside_the_prompt(servers):
    prompt = TOK.encode("3+4+1=", add_bos=True)
    out = _generate(servers["moe"], {"input_ids": prompt, "sampling_params": GREEDY,
                                     "return_routed_experts": True,
                                     "routed_experts_start_len": len(prompt)})
    rows = len(base64.b64decode(out["meta_info"]["routed_experts"])) // 4 // (2 * 2)
    assert rows == len(prompt) + 8 - 1 - len(prompt)  # (P + O − 1 − start, L=2, k=2)


def test_through_the_real_sglang_router(servers, tmp_path):
    """sglang-router 0.3.2 in front of the server: it probes /health, /server_info,
    /model_info, rewrites the body, and hands the answer back with its string version."""
    pytest.importorskip("sglang_router")
    port, metrics = free_port(), free_port()
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115 — the router owns it while it runs
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", servers["dense"],
         "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
            try:
                if HTTP.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "sglang-router never became healthy"
            time.sleep(0.2)
        body = {"text": "3+4+1=", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                                      "ignore_eos": True},
                "return_logprob": True, "logprob_start_len": -1, "rid": "via-router",
                "lora_path": None, "return_routed_experts": True, "routed_experts_start_len": 0}
        out = _generate(url, body)  # the router drops return_routed_experts (FACTS.md)
        direct = _generate(servers["dense"], ROUTER_BODY)
        assert out["output_ids"] == direct["output_ids"] and out["meta_info"]["id"] == "via-router"
        assert out["meta_info"]["weight_version"] == "0" and "routed_experts" not in \
            out["meta_info"]
        assert len(out["meta_info"]["output_token_logprobs"]) == 8
    finally:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(10)
        log.close()


# ------------------------------------------------------------------------------------------------
# control endpoints with SGLang's bodies, info endpoints' types
# ------------------------------------------------------------------------------------------------


def test_control_bodies_as_sglang_sends_them(servers):
    url = servers["dense"]
    for path, body in [("/pause_generation", {"rid": None, "mode": "in_place"}),
                       ("/continue_generation", {"rid": None, "torch_empty_cache": True}),
                       ("/flush_cache", {"rid": None, "timeout_s": 5.0}),
                       ("/abort_request", {"rid": "", "abort_all": False,
                                           "finished_reason": None, "abort_message": None}),
                       ("/abort_request", {"rid": "nobody", "abort_all": False}),
                       ("/abort_request", {"abort_all": True})]:
        r = _post(url, path, body)
        assert r.status_code == 200 and r.json()["success"] is True, (path, r.text)
    assert _post(url, "/abort_request", {}).json()["aborted"] == 0  # AbortReq's defaults
    assert HTTP.get(url + "/flush_cache").status_code == 200
    assert HTTP.get(url + "/health").status_code == 200
    assert HTTP.get(url + "/health_generate").status_code == 200
    models = HTTP.get(url + "/v1/models").json()
    assert models["object"] == "list" and isinstance(models["data"][0]["id"], str)
    assert isinstance(models["data"][0]["max_model_len"], int)
    [load] = HTTP.get(url + "/get_load").json()
    assert load["dp_rank"] == 0 and isinstance(load["num_tokens"], int)
    info = HTTP.get(url + "/get_model_info").json()
    assert info == HTTP.get(url + "/model_info").json()
    assert isinstance(info["model_path"], str) and info["is_generation"] is True
    assert isinstance(info["weight_version"], str)


# ------------------------------------------------------------------------------------------------
# wrong types: HTTP 400, one line naming the field, nothing done
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, words", [
    ("/update_weights_from_disk", {"model_path": "{dense_b}", "weight_version": 7},
     "weight_version: input should be a valid string, got 7"),
    ("/update_weights_from_disk", {"model_path": "{dense_b}", "weight_version": ["v7"]},
     "weight_version"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path: input should be a valid"),
    ("/update_weights_from_disk", {"weight_version": "v7"}, "model_path is required"),
    ("/update_weights_from_disk", {"model_path": "{dense_b}", "abort_all_requests": "yes"},
     "abort_all_requests: input should be a valid boolean"),
    ("/update_weights_from_disk", {"model_path": "{dense_b}", "token_step": "3"},
     "token_step: input should be a valid integer"),
    ("/update_weights_from_disk", {"model_path": "{dense_b}", "load_format": "gguf"},
     "load_format 'gguf'"),
    ("/update_weights_from_disk", {"model_path": "{dense_b}", "keep_pause": True},
     "keep_pause"),
    ("/update_weights_from_disk", ["{dense_b}"], "the body must be a JSON object"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "29500",
                                    "rank_offset": 1, "world_size": 2, "backend": "gloo"},
     "master_port: input should be a valid integer"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500,
                                    "rank_offset": 1, "backend": "gloo"},
     "world_size is required"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500,
                                    "rank_offset": 1, "world_size": 2},
     "backend 'nccl'"),  # SGLang's default backend; this server is CPU-only
    ("/update_weights_from_distributed", {"names": "model.norm.weight", "dtypes": ["float32"],
                                          "shapes": [[64]]}, "names: input should be a valid"),
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"],
                                          "shapes": [[64.5]]}, "shapes.0.0"),
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"],
                                          "shapes": [[64]], "weight_version": 8},
     "weight_version: input should be a valid string"),
    ("/update_weight_version", {"new_version": 3}, "new_version: input should be a valid"),
    ("/begin_weight_update", {"selector": "draft"}, "no draft"),
    ("/pause_generation", {"mode": "stop"}, "mode: input should be 'abort', 'retract' or"),
    ("/continue_generation", {"torch_empty_cache": 1}, "torch_empty_cache"),
    ("/abort_request", {"rid": 5}, "rid: input should be a valid string"),
    ("/abort_request", {"abort_all": "true"}, "abort_all: input should be a valid boolean"),
    ("/flush_cache", {"timeout_s": "soon"}, "timeout_s"),
    ("/generate", {"input_ids": [1, 5], "rid": 5}, "rid must be a string, got 5"),
    ("/generate", {"text": "a", "rid": ["x"]}, "rid must be a string, got ['x']"),
    ("/generate", {"text": ["a", "b"], "rid": ["x"]}, "rid has 1 ids for a batch of 2"),
    ("/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, "duplicate ids"),
    ("/generate", {"input_ids": [1, 5], "logprob_start_len": "-1"},
     "logprob_start_len must be an integer"),
    ("/generate", {"input_ids": [1, 5], "return_logprob": True, "logprob_start_len": 0},
     "input-token log-probs are not returned"),
    ("/generate", {"input_ids": [1, 5], "return_text_in_logprobs": "yes"},
     "return_text_in_logprobs must be true or false"),
    ("/generate", {"input_ids": [1, 5], "top_logprobs_num": 5}, "top_logprobs_num=5"),
    ("/generate", {"input_ids": [1, 5], "return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {"input_ids": [1, 5], "lora_path": "adapter"}, "no LoRA adapters"),
    ("/generate", {"input_ids": [1, 5], "image_data": "cat.png"}, "reads text only"),
    ("/generate", {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": "8"}},
     "max_new_tokens must be an integer"),
])
def test_wrong_types_are_400_with_one_line_naming_the_field(servers, ckpts, path, body, words):
    url = servers["dense"]
    body = json.loads(json.dumps(body).replace("{dense_b}", str(ckpts["dense_b"])))
    before = HTTP.get(url + "/server_info").json()
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    answer = r.json()
    message = answer["message"]
    assert words in message and "\n" not in message, message
    # SGLang's ErrorResponse fields (and error.message); weight endpoints also say success
    assert answer["object"] == "error" and answer["code"] == 400
    assert answer["error"]["message"] == message
    if "weight" in path:
        assert answer["success"] is False
    else:
        assert "success" not in answer
    after = HTTP.get(url + "/server_info").json()
    assert after["weight_version"] == before["weight_version"]  # nothing loaded
    st_before, st_after = before["internal_states"][0], after["internal_states"][0]
    for key in ("weight_updates", "requests_finished", "paused"):
        assert st_after[key] == st_before[key], key  # nothing queued, paused or swapped
