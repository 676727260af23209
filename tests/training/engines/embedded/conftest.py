"""Real embedded rollout servers for the HTTP tests of this package, one pair per test module: a
dense bf16 server started through ``asyncrl engine serve`` and an MoE fp32 one, on free
127.0.0.1 ports, over small random checkpoints (``ckpts``: dense, dense_b (other weights), moe;
each names weight version 0 in its ``asyncrl.json``)."""

import sys

import pytest

from training.engines.embedded.launch import EmbeddedServer, start_all
from training.engines.hf_io import save_hf_dir
from training.engines.model import CausalLM, ModelConfig
from training.tasks.tokenizer import CharTokenizer


def _checkpoint(path, *, experts=0, seed=0, version=0):
    cfg = ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, intermediate_size=96,
                      max_position_embeddings=512, num_experts=experts, num_experts_per_tok=2)
    return save_hf_dir(path, CausalLM(cfg).init_weights(seed, std=0.15), CharTokenizer(),
                       weight_version=version)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"dense": _checkpoint(root / "dense"), "dense_b": _checkpoint(root / "b", seed=1),
            "moe": _checkpoint(root / "moe", experts=4)}


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    dense = EmbeddedServer(ckpts["dense"], dtype="bf16", max_batch=16, log_path=logs / "d.log",
                           entry=[sys.executable, "-m", "ui.cli", "engine", "serve"])
    moe = EmbeddedServer(ckpts["moe"], dtype="fp32", max_batch=16, log_path=logs / "m.log")
    start_all([dense, moe])
    yield {"dense": dense.url, "moe": moe.url}
    dense.stop()
    moe.stop()
