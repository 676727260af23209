import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from training.engines.hf_io import save_hf_dir
from training.engines.mismatch import routing_flip_rate, run_mismatch_check
from training.engines.model import CausalLM, ModelConfig
from training.tasks.tokenizer import CharTokenizer
from ui.cli import app

TOK = CharTokenizer()


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "moe"
    cfg = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=4, intermediate_size=48, num_experts=4)
    save_hf_dir(path, CausalLM(cfg).init_weights(0, 0.1), TOK)
    return path


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))


def test_routing_flip_rate_compares_expert_sets():
    a = np.array([[[0, 1], [2, 3]], [[1, 0], [0, 2]]])          # (positions 2, layers 2, k 2)
    b = torch.tensor([[[1, 0], [2, 3]], [[1, 0], [0, 3]]])      # same sets except one cell
    assert routing_flip_rate([a], [b]) == pytest.approx(1 / 4)
    assert routing_flip_rate([None], [None]) is None


def test_fp32_engine_agrees_with_trainer(moe_ckpt):
    report = run_mismatch_check(moe_ckpt, prompts=8, dtype="fp32")
    m = report.metrics
    assert report.sequences == 8 and report.tokens > 0
    assert m["mismatch/engine/logprob_abs_diff/max"] < 1e-4
    assert m["mismatch/engine/exact"] == 1.0
    assert not [k for k in m if k.startswith("mismatch/") and not k.startswith(
        ("mismatch/engine/", "mismatch/r3/"))]
    assert m["moe/routing_flip_rate"] == 0.0
    assert report.diagnosis.healthy and report.verdict == "no meaningful drift"


def test_bf16_engine_shows_real_mismatch_and_r3_reduces_it(moe_ckpt):
    m = run_mismatch_check(moe_ckpt, prompts=16, dtype="bf16").metrics
    assert 1e-4 < m["mismatch/engine/logprob_abs_diff/mean"] < 0.1
    assert m["mismatch/r3/logprob_abs_diff/mean"] <= m["mismatch/engine/logprob_abs_diff/mean"]


def test_cli_json_and_bad_checkpoint(moe_ckpt, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["check-mismatch", "--checkpoint", str(moe_ckpt), "--prompts", "4",
                              "--dtype", "fp32", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["verdict"] == "no meaningful drift" and "mismatch/engine/kl_k3" in out["metrics"]
    (tmp_path / "empty").mkdir()
    res = runner.invoke(app, ["check-mismatch", "--checkpoint", str(tmp_path / "empty")])
    assert res.exit_code == 1 and "refusing to start from random weights" in res.stderr
    assert "Traceback" not in res.output


def test_engine_serving_other_weights_is_refused(moe_ckpt, tmp_path):
    from training.engines.embedded.launch import EmbeddedServer
    from training.engines.hf_io import load_hf_dir
    from training.engines.rollout import RolloutEngineError

    other = tmp_path / "v5"
    save_hf_dir(other, load_hf_dir(moe_ckpt).model, TOK, weight_version=5)
    with EmbeddedServer(other, dtype="fp32") as server:
        server.wait_ready()
        with pytest.raises(RolloutEngineError, match="serves weight version 5"):
            run_mismatch_check(moe_ckpt, server.url, prompts=2)


@pytest.mark.slow
def test_engine_serving_other_weights_of_the_same_version_is_refused(moe_ckpt, tmp_path):
    from training.engines.embedded.launch import EmbeddedServer
    from training.engines.rollout import RolloutEngineError

    cfg = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=4, intermediate_size=48, num_experts=4)
    other = tmp_path / "other"
    save_hf_dir(other, CausalLM(cfg).init_weights(1, 0.1), TOK)      # version 0 too
    copy = tmp_path / "copy"
    save_hf_dir(copy, CausalLM(cfg).init_weights(0, 0.1), TOK)       # same weights, other path
    with EmbeddedServer(other, dtype="fp32") as server:
        with pytest.raises(RolloutEngineError, match=r"not .*start it on this checkpoint"):
            run_mismatch_check(moe_ckpt, server.url, prompts=2)
        assert server.log_path.parent == tmp_path / "home" / "logs"  # logs in the state dir
    with EmbeddedServer(copy, dtype="fp32") as server:
        report = run_mismatch_check(moe_ckpt, server.url, prompts=2)
        assert report.metrics["mismatch/engine/logprob_abs_diff/max"] < 1e-4
