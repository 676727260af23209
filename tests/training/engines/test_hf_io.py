import json

import pytest
import torch

from training.engines.hf_io import CheckpointError, load_hf_dir, read_meta, save_hf_dir
from training.engines.model import CausalLM, ModelConfig
from training.tasks.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _model(experts=0):
    cfg = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, intermediate_size=40, num_experts=experts)
    return CausalLM(cfg).init_weights(0, std=0.2)


@pytest.mark.parametrize("experts", [0, 4])
def test_round_trip_is_exact(tmp_path, experts):
    m = _model(experts)
    save_hf_dir(tmp_path / "ck", m, TOK, weight_version=7, meta={"task": "sum_digits"})
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == ["asyncrl.json", "config.json", "generation_config.json",
                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    loaded = load_hf_dir(tmp_path / "ck")
    assert loaded.weight_version == 7 and loaded.meta["task"] == "sum_digits"
    for k, v in m.state_dict().items():
        assert torch.equal(v, loaded.model.state_dict()[k]), k
    assert not list(tmp_path.glob(".ck.tmp-*"))  # nothing half-written left behind


@pytest.mark.parametrize("experts", [0, 4])
def test_transformers_loads_checkpoint_with_same_logits(tmp_path, experts):
    transformers = pytest.importorskip("transformers")
    m = _model(experts)
    save_hf_dir(tmp_path / "ck", m, TOK)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32)
    ids = torch.tensor([TOK.encode("1+2+3=1,3,6", add_bos=True)])
    with torch.no_grad():
        ours, _ = m(ids)
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "ck")
    assert tok("1+2=3")["input_ids"] == TOK.encode("1+2=3")
    assert tok.eos_token_id == TOK.eos_token_id


def test_resume_guard_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty; refusing to start from random weights"):
        load_hf_dir(tmp_path / "empty")
    save_hf_dir(tmp_path / "ck", _model(), TOK)
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_hf_dir(tmp_path / "ck")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"lacks model\.safetensors"):
        load_hf_dir(tmp_path / "half")


def test_overwrite_replaces_atomically(tmp_path):
    save_hf_dir(tmp_path / "ck", _model(), TOK, weight_version=1)
    save_hf_dir(tmp_path / "ck", _model(), TOK, weight_version=2)
    assert read_meta(tmp_path / "ck")["weight_version"] == 2
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_corrupt_tokenizer_and_meta_are_checkpoint_errors(tmp_path):
    save_hf_dir(tmp_path / "ck", _model(), TOK)
    (tmp_path / "ck" / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is unreadable"):
        load_hf_dir(tmp_path / "ck")
    save_hf_dir(tmp_path / "ck2", _model(), TOK)
    (tmp_path / "ck2" / "asyncrl.json").write_text('{"weight_version": "abc"}')
    with pytest.raises(CheckpointError, match="weight_version must be an integer"):
        load_hf_dir(tmp_path / "ck2")
