"""The server's options (``ServerConfig``: the one definition the argparse parser, ``asyncrl engine
serve`` and ``EmbeddedServer`` are built from) and its routes in process: which endpoints it
serves, and a malformed or wrong-typed body on each → HTTP 400 in one line naming the field, with
nothing done. Bodies as SGLang sends them and the answers over real HTTP are in
test_sglang_contract.py and test_rollout_server.py."""

import argparse
import os
import subprocess
import sys

import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from training.engines.embedded.launch import EmbeddedServer
from training.engines.embedded.server import (
    ServerConfig,
    ServerConfigError,
    add_arguments,
    build_state,
    create_app,
)

# ------------------------------------------------------------------------------------------------
# options
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"port": 70000}, "--port 70000: input should be less than or equal to 65535"),
    ({"port": -1}, "--port -1: input should be greater than or equal to 0"),
    ({"max_batch": 0}, "--max-batch 0: input should be greater than or equal to 1"),
    ({"threads": 0}, "--threads 0: input should be greater than or equal to 1"),
    ({"dtype": "fp16"}, "--dtype 'fp16': input should be 'bf16', 'fp32' or 'fp8'"),
    ({"logit_noise": -0.1}, "--logit-noise -0.1: input should be greater than or equal to 0"),
    ({"logit_noise": float("nan")}, "--logit-noise nan: input should be a finite number"),
    ({"log_level": "loud"}, "--log-level 'loud': input should be 'critical', 'error', "
                            "'warning', 'info', 'debug' or 'trace'"),
    ({"max_batch": 0, "threads": 0},
     "--max-batch 0: input should be greater than or equal to 1 (and 1 more)"),
    ({"checkpoint": None}, "--checkpoint None: input should be a valid string"),
    ({"max_batchs": 8}, "max_batchs is not a server option; the options are checkpoint, host, "
                        "port, dtype, logit_noise, seed, max_batch, threads, "
                        "served_model_name, log_level, weight_version"),
])
def test_server_config_refuses_a_bad_option_in_one_line(options, message):
    with pytest.raises(ServerConfigError) as e:
        ServerConfig(**{"checkpoint": "ckpt", **options})
    assert str(e.value) == message


def test_server_config_requires_a_checkpoint_and_is_frozen():
    with pytest.raises(ServerConfigError, match=r"^--checkpoint is required$"):
        ServerConfig()
    cfg = ServerConfig(checkpoint="ckpt")
    with pytest.raises(ValueError, match="frozen"):
        cfg.port = 1
    assert cfg.model_copy(update={"port": 1}).port == 1 and cfg.port == 30000


def _parser():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_the_parser_has_exactly_the_model_fields_with_their_defaults_and_help():
    actions = {a.dest: a for a in _parser()._actions if a.dest != "help"}
    assert list(actions) == [*ServerConfig.model_fields, "parent_pid"]
    for name, field in ServerConfig.model_fields.items():
        action = actions[name]
        assert action.option_strings == ["--" + name.replace("_", "-")]
        assert action.help == field.description and action.help
        assert action.required == field.is_required()
        if not field.is_required():
            assert action.default == field.default, name
    assert actions["checkpoint"].required and actions["port"].type is int
    assert actions["logit_noise"].type is float and actions["weight_version"].type is str
    assert actions["dtype"].choices == ("bf16", "fp32", "fp8")
    assert actions["log_level"].choices == ("critical", "error", "warning", "info", "debug",
                                            "trace")
    options = vars(_parser().parse_args(["--checkpoint", "ckpt"]))
    assert options.pop("parent_pid") is None
    assert options == ServerConfig(checkpoint="ckpt").model_dump()


def test_argv_parses_back_into_the_same_config():
    cfg = ServerConfig(checkpoint="/ckpt dir", host="0.0.0.0", port=0, dtype="fp8",
                       logit_noise=0.125, seed=-3, max_batch=2, threads=3,
                       served_model_name="tiny", log_level="debug", weight_version="v7")
    options = vars(_parser().parse_args(cfg.argv()))
    del options["parent_pid"]
    assert ServerConfig(**options) == cfg
    assert "--served-model-name" not in ServerConfig(checkpoint="c").argv()  # None: left out


def _run_module(*args):
    return subprocess.run([sys.executable, "-m", "training.engines.embedded.server", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_the_module_refuses_bad_options_in_one_line_without_a_traceback():
    res = _run_module("--checkpoint", "X", "--dtype", "fp16")
    assert res.returncode == 2  # argparse: not among the choices
    assert res.stderr == ("error: argument --dtype: invalid choice: 'fp16' (choose from 'bf16', "
                          "'fp32', 'fp8'); see --help\n")
    res = _run_module("--checkpoint", "X", "--port", "70000")
    assert res.returncode == 1  # pydantic: out of range
    assert res.stderr == "error: --port 70000: input should be less than or equal to 65535\n"
    assert res.stdout == ""


@pytest.mark.parametrize("args, code, message", [
    (["--dtype", "fp16"], 2, "error: argument --dtype: invalid choice: 'fp16' (choose from "
                             "'bf16', 'fp32', 'fp8'); see --help"),
    (["--max-batch", "0"], 1, "error: --max-batch 0: input should be greater than or equal to 1"),
    (["--port", "x"], 2, "error: argument --port: invalid int value: 'x'; see --help"),
])
def test_engine_serve_refuses_bad_options_as_the_module_does(args, code, message):
    from ui.cli import app

    res = CliRunner().invoke(app, ["engine", "serve", "--checkpoint", "X", *args])
    assert res.exit_code == code and res.output == message + "\n"


def test_engine_serve_help_lists_the_model_fields():
    from ui.cli import app

    res = CliRunner().invoke(app, ["engine", "serve", "--help"])
    assert res.exit_code == 0 and res.output.startswith("usage: asyncrl engine serve")
    for name in ServerConfig.model_fields:
        assert "--" + name.replace("_", "-") in res.output


def test_embedded_server_options_come_from_server_config(tmp_path):
    server = EmbeddedServer("ckpt", port=5, dtype="fp32", max_batch=8, log_path=tmp_path / "l")
    cfg = ServerConfig(checkpoint="ckpt", port=5, dtype="fp32", max_batch=8)
    assert server.config == cfg and server.url == "http://127.0.0.1:5"
    assert server.command() == [sys.executable, "-m", "training.engines.embedded.server",
                                *cfg.argv(), "--parent-pid", str(os.getpid())]
    cli = EmbeddedServer("ckpt", port=5, dtype="fp32", max_batch=8, log_path=tmp_path / "l",
                         entry=["asyncrl", "engine", "serve"])
    assert cli.command() == ["asyncrl", "engine", "serve", *cfg.argv()]  # no --parent-pid
    with pytest.raises(ServerConfigError, match=r"^--max-batch 0: input should be greater"):
        EmbeddedServer("ckpt", max_batch=0, log_path=tmp_path / "l")


# ------------------------------------------------------------------------------------------------
# routes
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(ckpts):
    threads = torch.get_num_threads()  # build_state sets the server's thread count
    state = build_state(ServerConfig(checkpoint=str(ckpts["dense"]), dtype="fp32", threads=1))
    try:
        with TestClient(create_app(state)) as c:
            yield c
    finally:
        state.core.stop()
        torch.set_num_threads(threads)


ENDPOINTS = {  # SGLang's paths and methods (module docstring of the server)
    "/generate": {"POST", "PUT"},
    "/update_weights_from_disk": {"POST"}, "/init_weights_update_group": {"POST"},
    "/update_weights_from_distributed": {"POST"}, "/begin_weight_update": {"POST"},
    "/end_weight_update": {"POST"}, "/update_weight_version": {"POST"},
    "/pause_generation": {"POST"}, "/continue_generation": {"POST"},
    "/abort_request": {"POST"}, "/flush_cache": {"GET", "POST"},
    "/get_weight_version": {"GET"}, "/health": {"GET"}, "/health_generate": {"GET"},
    "/model_info": {"GET"}, "/get_model_info": {"GET"}, "/server_info": {"GET"},
    "/get_server_info": {"GET"}, "/v1/models": {"GET"}, "/get_load": {"GET"},
}
WEIGHT_PATHS = {"/update_weights_from_disk", "/init_weights_update_group",
                "/update_weights_from_distributed", "/begin_weight_update", "/end_weight_update",
                "/update_weight_version"}
BODY_PATHS = sorted(p for p, methods in ENDPOINTS.items() if "POST" in methods)


def test_the_app_serves_exactly_sglangs_endpoints(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {path: {m.upper() for m in ops} for path, ops in paths.items()} == ENDPOINTS


def _engine_state(client):
    info = client.get("/server_info").json()
    st = info["internal_states"][0]
    return info["weight_version"], st["weight_updates"], st["requests_finished"], st["paused"]


def _assert_400(r, path, words):
    assert r.status_code == 400, r.text
    answer = r.json()
    message = answer["message"]
    assert words in message and "\n" not in message, message
    assert answer["object"] == "error" and answer["error"]["message"] == message
    assert answer.get("success", "absent") == (False if path in WEIGHT_PATHS else "absent")


@pytest.mark.parametrize("path", BODY_PATHS)
@pytest.mark.parametrize("raw, words", [
    (b'{"mode": ', "body is not valid JSON"),
    (b'\xff\xfe{}', "body is not valid JSON"),
    (b'[1, 2]', "the body must be a JSON object"),
])
def test_a_malformed_body_is_400_on_every_endpoint_with_a_body(client, path, raw, words):
    before = _engine_state(client)
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    _assert_400(r, path, words)
    assert _engine_state(client) == before


def test_a_malformed_body_is_400_on_get_flush_cache(client):
    r = client.request("GET", "/flush_cache", content=b"{oops")
    _assert_400(r, "/flush_cache", "body is not valid JSON")


GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
         "world_size": 2, "backend": "gloo"}


@pytest.mark.parametrize("path, body, words", [
    ("/pause_generation", {"mode": 3}, "mode: input should be 'abort', 'retract' or 'in_place'"),
    ("/pause_generation", {"rid": 7}, "rid: input should be a valid string, got 7"),
    ("/continue_generation", {"torch_empty_cache": "yes"},
     "torch_empty_cache: input should be a valid boolean, got 'yes'"),
    ("/abort_request", {"abort_all": 1}, "abort_all: input should be a valid boolean, got 1"),
    ("/abort_request", {"rid": ["a"]}, "rid: input should be a valid string"),
    ("/flush_cache", {"timeout_s": "soon"}, "timeout_s: input should be a valid number"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path: input should be a valid string"),
    ("/init_weights_update_group", {**GROUP, "world_size": "2"},
     "world_size: input should be a valid integer, got '2'"),
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": "float32", "shapes": [[1]]},
     "dtypes: input should be a valid list"),
    ("/begin_weight_update", {"selector": 5}, "selector: input should be a valid string"),
    ("/end_weight_update", {"selector": ["all"]}, "selector: input should be a valid string"),
    ("/update_weight_version", {"new_version": "v", "abort_all_requests": "no"},
     "abort_all_requests: input should be a valid boolean"),
])
def test_a_wrong_typed_field_is_400_naming_it_on_each_control_endpoint(client, path, body,
                                                                        words):
    before = _engine_state(client)
    _assert_400(client.post(path, json=body), path, words)
    assert _engine_state(client) == before  # nothing paused, aborted, loaded or relabelled


def test_control_endpoints_answer_as_before_the_split(client):
    assert client.post("/pause_generation", json={"mode": "in_place"}).json() == {
        "success": True, "status": "ok", "message": "paused (in_place); 0 running requests "
                                                    "affected"}
    assert _engine_state(client)[3] == "in_place"
    assert client.post("/continue_generation").json() == {
        "success": True, "status": "ok", "message": "generation continued"}
    assert client.post("/abort_request", json={"abort_all": True}).json() == {
        "success": True, "aborted": 0}
    assert client.get("/flush_cache").json() == {"success": True,
                                                 "message": "no prefix cache to flush"}
    assert client.get("/get_weight_version").json() == {"weight_version": "0"}
    assert client.post("/end_weight_update", json={}).status_code == 400  # no session open
