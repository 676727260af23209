"""``MegatronTrainEngine.init_weight_sync`` / ``push_weights`` (``engines.sglang.weight_sync:
nccl``) with gloo on CPU, against the embedded server as the stand-in SGLang engine: rank 0
broadcasts ``hf_state_dict()`` and the server then serves exactly like a server that loaded the
same weights from disk."""

from __future__ import annotations

import httpx
import pytest
import torch

pytest.importorskip("megatron.core")


def _greedy(url: str) -> dict:
    from training.tasks.tokenizer import CharTokenizer

    body = {"input_ids": CharTokenizer().encode("12+34=", add_bos=True), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
    resp = httpx.post(url + "/generate", json=body, timeout=60)
    resp.raise_for_status()
    return resp.json()


def test_push_weights_delivers_hf_state_dict_from_rank_0(mg, tmp_path):
    from training.engines.embedded.launch import EmbeddedServer, start_all
    from training.engines.embedded.trainer import EmbeddedTrainEngine
    from training.engines.megatron.engine import MegatronTrainEngine
    from training.engines.sglang.nccl_sync import NcclSyncError

    engine = MegatronTrainEngine.from_pretrained(mg.hf_dir(), optim=mg.OPTIM, launcher="local")
    try:
        hf = engine.hf_state_dict()
        # the receiver starts from other weights; the reference loads the trainer's from disk
        start = tmp_path / "start"
        EmbeddedTrainEngine.from_config(mg.cfg(), seed=11).export_weights(start)
        engine.export_weights(tmp_path / "trainer")
        pushed = EmbeddedServer(start, threads=1)
        from_disk = EmbeddedServer(tmp_path / "trainer", threads=1)
        start_all([pushed, from_disk], timeout=120)
        try:
            before = _greedy(pushed.url)
            with pytest.raises(NcclSyncError, match="init_weight_sync"):
                engine.push_weights(7)
            info = engine.init_weight_sync([pushed.url], 1, "asyncrl-weights-1", "127.0.0.1",
                                           backend="gloo")
            assert (info.world_size, info.backend, info.engines) == (2, "gloo", 1)
            report = engine.push_weights(7)
            assert report.version == 7 and report.tensors == len(hf)
            assert report.bytes == sum(t.numel() * 2 for t in hf.values())  # bf16
            info = httpx.get(pushed.url + "/model_info").json()
            assert info["weight_version"] == "7"  # SGLang reports version labels as strings
            assert info["model_path"] == "(broadcast over asyncrl-weights-1)"
            after, want = _greedy(pushed.url), _greedy(from_disk.url)
            assert after["output_ids"] == want["output_ids"] != before["output_ids"]
            assert after["meta_info"]["output_token_logprobs"] == \
                want["meta_info"]["output_token_logprobs"]
            # the engine's own weights are untouched by the push
            again = engine.hf_state_dict()
            assert all(torch.equal(again[k], hf[k]) for k in hf)
        finally:
            pushed.stop()
            from_disk.stop()
    finally:
        engine.close()
