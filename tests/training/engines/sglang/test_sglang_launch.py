"""The exact sglang.launch_server / sglang_router command lines and environments for recipes."""

import sys

import pytest

from training.engines.sglang.launch import (
    SGLANG_MISSING,
    BackendUnavailable,
    ServerSpec,
    require_sglang,
    router_command,
    server_args,
    server_command,
    server_env,
)
from training.recipe import recipe_from_dict


def recipe(**engines_sglang):
    return recipe_from_dict({"name": "dense", "seed": 7,
                             "engines": {"rollout": "sglang", "sglang": engines_sglang}})


def moe_r3_recipe(**engines_sglang):
    return recipe_from_dict({
        "name": "moe", "seed": 3,
        "model": {"kind": "warmstart", "moe_experts": 4, "moe_top_k": 2},
        "algorithm": {"routing_replay": "r3"},
        "engines": {"rollout": "sglang", "max_batch": 256, "sglang": engines_sglang}})


def test_dense_default_command_line():
    spec = ServerSpec(model_path="/ckpt/hf", port=31000, weight_version=5, index=1)
    assert server_command(recipe(), spec, python="/venv/bin/python") == [
        "/venv/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/ckpt/hf", "--host", "127.0.0.1", "--port", "31000",
        "--tp-size", "1", "--mem-fraction-static", "0.8", "--dtype", "bfloat16",
        "--skip-tokenizer-init", "--weight-version", "5", "--random-seed", "8",
        "--max-running-requests", "64"]


def test_moe_r3_tp2_deterministic_with_extra_args():
    r = moe_r3_recipe(tp_size=2, mem_fraction_static=0.65, deterministic=True,
                      extra_args=["--dtype", "float16", "--log-level", "warning"])
    spec = ServerSpec(model_path="/w/v12", port=30001, host="10.0.0.7", weight_version=12,
                      index=0)
    assert server_args(r, spec) == [
        "--model-path", "/w/v12", "--host", "10.0.0.7", "--port", "30001",
        "--tp-size", "2", "--mem-fraction-static", "0.65", "--dtype", "bfloat16",
        "--skip-tokenizer-init", "--weight-version", "12", "--random-seed", "3",
        "--max-running-requests", "256",
        "--enable-return-routed-experts", "--enable-deterministic-inference",
        # extra args last: argparse keeps the last --dtype
        "--dtype", "float16", "--log-level", "warning"]


def test_moe_without_r3_does_not_ask_for_routed_experts():
    r = recipe_from_dict({"name": "moe-r2", "model": {"kind": "warmstart", "moe_experts": 4},
                          "algorithm": {"routing_replay": "r2"},
                          "engines": {"rollout": "sglang"}})
    args = server_args(r, ServerSpec(model_path="/m", port=30000))
    assert "--enable-return-routed-experts" not in args
    assert "--enable-deterministic-inference" not in args


def test_engine_index_seeds_sampling_differently():
    r = recipe()
    seeds = [server_args(r, ServerSpec("/m", 30000, index=i))[-3] for i in range(3)]
    assert seeds == ["7", "8", "9"]


def test_spec_rejects_bad_ports_and_indices():
    with pytest.raises(ValueError, match="port"):
        ServerSpec("/m", 0)
    with pytest.raises(ValueError, match=">= 0"):
        ServerSpec("/m", 30000, index=-1)


def test_env_exposes_the_ray_assigned_gpus():
    base = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
            "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    env = server_env(base, [2, 3], tp_size=2)
    assert env == {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert server_env(base, ["5"], tp_size=1)["CUDA_VISIBLE_DEVICES"] == "5"
    # no assignment (a CPU test): left as it was, minus the log-prob switch
    assert server_env(base, [], tp_size=2) == {"PATH": "/usr/bin",
                                                "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert base["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"  # the input is not modified


def test_env_refuses_gpus_that_do_not_match_tp():
    with pytest.raises(ValueError, match="tp_size is 2"):
        server_env({}, [0], tp_size=2)
    with pytest.raises(ValueError, match="duplicate"):
        server_env({}, [1, 1], tp_size=2)


def test_router_command_binds_prometheus_locally():
    cmd = router_command(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], port=30100,
                         prometheus_port=30101, python="py")
    assert cmd == ["py", "-m", "sglang_router.launch_router",
                   "--worker-urls", "http://10.0.0.1:30000", "http://10.0.0.2:30000",
                   "--policy", "cache_aware", "--host", "127.0.0.1", "--port", "30100",
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", "30101"]
    with pytest.raises(ValueError, match="policy"):
        router_command(["http://a:1"], port=1, prometheus_port=2, policy="fastest")
    with pytest.raises(ValueError, match="at least one"):
        router_command([], port=1, prometheus_port=2)


def test_require_sglang_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang → ImportError
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(BackendUnavailable) as err:
        require_sglang()
    assert str(err.value) == SGLANG_MISSING
    assert 'pip install -e ".[gpu]"' in str(err.value)
