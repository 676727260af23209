"""The broadcast weight sync against the embedded server's own ``/init_weights_update_group`` and
``/update_weights_from_distributed`` (gloo on CPU): the trainer side (:class:`TrainerNcclPusher`)
pushes a train engine's weights, and the server then generates exactly like a server that loaded
the same weights from disk; a second group (after an engine restart) replaces the first.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from training.engines.embedded.launch import EmbeddedServer, start_all
from training.engines.hf_io import save_hf_dir, state_dict_for_export
from training.engines.model import CausalLM, ModelConfig
from training.engines.sglang.nccl_sync import NcclSyncError, TrainerNcclPusher, hf_weights_of
from training.tasks.tokenizer import CharTokenizer

TOK = CharTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=4, intermediate_size=48, max_position_embeddings=128)


class _Engine:
    """What the pusher needs of the embedded train engine: ``.model``."""

    def __init__(self, seed: int) -> None:
        self.model = CausalLM(CFG).init_weights(seed, 0.1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("nccl-embedded")
    start = save_hf_dir(root / "v0", _Engine(0).model, TOK, weight_version=0)
    target = save_hf_dir(root / "v5", _Engine(1).model, TOK, weight_version=5)
    pushed, from_disk = EmbeddedServer(start, threads=1), EmbeddedServer(target, threads=1)
    start_all([pushed, from_disk], timeout=120)
    try:
        yield pushed.url, from_disk.url
    finally:
        pushed.stop()
        from_disk.stop()


def _greedy(url: str) -> dict:
    body = {"input_ids": TOK.encode("12+34=", add_bos=True), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
    resp = httpx.post(url + "/generate", json=body, timeout=60)
    resp.raise_for_status()
    return resp.json()


def test_hf_weights_of_either_engine():
    eng = _Engine(3)
    want = state_dict_for_export(eng.model)
    got = hf_weights_of(eng)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    class Megatronish:
        def hf_state_dict(self):
            return {"x": torch.ones(2)}

    assert list(hf_weights_of(Megatronish())) == ["x"]
    with pytest.raises(TypeError, match="no weights"):
        hf_weights_of(object())


def test_pushed_weights_serve_like_the_same_weights_from_disk(servers):
    pushed, from_disk = servers
    before = _greedy(pushed)
    pusher = TrainerNcclPusher(bucket_bytes=4096)  # several buckets
    with pytest.raises(NcclSyncError, match="init"):
        pusher.push(_Engine(1), 5)
    try:
        info = pusher.init([pushed], 1, "asyncrl-weights-1", "127.0.0.1", backend="gloo")
        assert (info.world_size, info.group_name) == (2, "asyncrl-weights-1")
        report = pusher.push(_Engine(1), 5)
        assert report.buckets > 1 and report.version == 5
        assert httpx.get(pushed + "/model_info").json()["weight_version"] == "5"
        after, want = _greedy(pushed), _greedy(from_disk)
        assert after["output_ids"] == want["output_ids"] != before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == \
            want["meta_info"]["output_token_logprobs"]
        assert set(after["meta_info"]["output_token_weight_versions"]) == {"5"}

        # a new group (what the runtime makes after an engine restart) replaces the old one
        pusher.init([pushed], 1, "asyncrl-weights-2", "127.0.0.1", backend="gloo")
        pusher.push(_Engine(0), 6)
        assert httpx.get(pushed + "/model_info").json()["weight_version"] == "6"
        assert _greedy(pushed)["output_ids"] == before["output_ids"]
    finally:
        pusher.close()


def test_the_embedded_server_refuses_nccl_and_unknown_groups(servers):
    pushed, _ = servers
    resp = httpx.post(pushed + "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
        "group_name": "g", "backend": "nccl"})
    assert resp.status_code == 400 and "use backend gloo" in resp.json()["message"]
    update = {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[32]],
              "group_name": "nope"}
    resp = httpx.post(pushed + "/update_weights_from_distributed", json=update)
    assert resp.status_code == 400 and resp.json()["message"] == (
        "update_weights_from_distributed must run between /begin_weight_update and "
        "/end_weight_update")
    assert httpx.post(pushed + "/begin_weight_update", json={}).json()["success"]
    resp = httpx.post(pushed + "/begin_weight_update", json={})
    assert resp.status_code == 400 and "already open" in resp.json()["message"]
    try:
        resp = httpx.post(pushed + "/update_weights_from_distributed", json=update)
        assert resp.status_code == 400 and "/init_weights_update_group first" in \
            resp.json()["message"]
    finally:
        assert httpx.post(pushed + "/end_weight_update", json={}).json()["success"]
    resp = httpx.post(pushed + "/end_weight_update", json={})
    assert resp.status_code == 400 and "no weight-update session" in resp.json()["message"]
