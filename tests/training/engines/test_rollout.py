import base64

import numpy as np
import pytest

from training.engines.rollout import (
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    RolloutEngine,
    RolloutEngineError,
    SamplingParams,
    decode_routed_experts,
    encode_routed_experts,
    parse_weight_version,
    weight_version_label,
)


def test_sampling_params_round_trip_through_sglang_json():
    p = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=4, stop=("\n",),
                       stop_token_ids=(5,), n=3, seed=11, ignore_eos=True)
    d = p.to_sglang()
    assert d["sampling_seed"] == 11 and d["stop"] == ["\n"] and d["stop_token_ids"] == [5]
    assert SamplingParams.from_sglang(d) == p


def test_sampling_params_accept_sglang_spellings():
    p = SamplingParams.from_sglang({"stop": "x", "seed": 3, "top_k": 0, "frequency_penalty": 0.0,
                                    "spaces_between_special_tokens": False})
    assert p.stop == ("x",) and p.seed == 3 and p.top_k == -1
    assert SamplingParams.from_sglang(None) == SamplingParams()


@pytest.mark.parametrize("bad, words", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"beam_width": 2}, "unknown sampling_params"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"n": 0}, "n must be"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "integer"),
    (5, "sampling_params must be a JSON object"),
    ([{"n": 1}], "sampling_params must be a JSON object"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"),
    ({"stop": [1]}, "stop must be a string or a list of strings"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"max_new_tokens": float("inf")}, "max_new_tokens must be an integer"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"n": "2"}, "n must be an integer"),
    ({"top_p": True}, "top_p must be a finite number"),
])
def test_sampling_params_reject_what_the_engine_cannot_honour(bad, words):
    with pytest.raises(ValueError, match=words) as err:
        SamplingParams.from_sglang(bad)
    assert "\n" not in str(err.value)


def test_generate_request_body_and_token_estimate():
    r = GenerateRequest([1, 5, 6], SamplingParams(max_new_tokens=10, n=2),
                        return_routed_experts=True, routed_experts_start_len=1, rid="a")
    body = r.to_sglang()
    assert body["input_ids"] == [1, 5, 6] and body["return_logprob"] is True
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 1
    assert body["rid"] == "a"
    assert r.estimated_tokens == 3 + 10 * 2
    with pytest.raises(ValueError, match="empty"):
        GenerateRequest([])


def test_routed_experts_codec_is_sglang_row_major_int32():
    routes = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    b64 = encode_routed_experts(routes)
    assert base64.b64decode(b64) == routes.tobytes()  # row-major int32 bytes
    np.testing.assert_array_equal(decode_routed_experts(b64, 3, 2), routes)
    with pytest.raises(RolloutEngineError, match="moe_layout"):
        decode_routed_experts(b64, 5, 2)  # 12 ids are not a multiple of 10


def test_generate_result_parses_an_sglang_answer():
    routes = np.ones((3 + 2 - 1, 2, 2), dtype=np.int32)
    out = {"text": "ab", "output_ids": [7, 2], "meta_info": {
        "id": "r1", "finish_reason": {"type": "stop", "matched": 2},
        "weight_version": "4", "output_token_weight_versions": [3, 4],
        "output_token_logprobs": [[-0.5, 7, None], [-0.25, 2, None]],
        "routed_experts": encode_routed_experts(routes)}}
    r = GenerateResult.from_sglang(out, [1, 5, 6], moe_layout=(2, 2), engine_url="u")
    assert r.output_ids == [7, 2] and r.output_logprobs == [-0.5, -0.25]
    assert r.finish_reason == "stop" and r.finish_detail["matched"] == 2
    assert r.weight_version == 4 and r.spans_weight_update and not r.aborted
    assert r.routed_experts.shape == (4, 2, 2) and r.engine_url == "u" and r.rid == "r1"
    assert (r.prompt_tokens, r.completion_tokens) == (3, 2)


def test_generate_result_defaults_for_plain_sglang_fields():
    # SGLang before any update reports weight_version "default"; no per-token versions
    out = {"text": "", "output_ids": [3, 3], "meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "weight_version": "default"}}
    r = GenerateResult.from_sglang(out, [1])
    assert r.weight_version == 0 and r.output_token_weight_versions == [0, 0]
    assert r.output_logprobs is None and r.routed_experts is None
    with pytest.raises(RolloutEngineError, match="moe_layout"):
        GenerateResult.from_sglang({"output_ids": [], "meta_info": {"routed_experts": ""}}, [1])


def test_weight_versions_go_out_as_labels_and_come_back_as_the_ints_named():
    for v in (0, 1, 7, 12345678901234):
        assert weight_version_label(v) == str(v) and parse_weight_version(str(v)) == v
    assert parse_weight_version(None) == parse_weight_version("default") == 0  # SGLang's start
    assert parse_weight_version(5) == 5  # a bare JSON integer (older asyncrl engines)
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ValueError, match="integer >= 0"):
            weight_version_label(bad)
    for foreign in ("v7", "-3", " 7", "7.0", "", "٣", True, 1.5, [7]):
        with pytest.raises(RolloutEngineError, match="a label asyncrl did not give"):
            parse_weight_version(foreign)


def test_model_info_reads_embedded_and_sglang_shapes():
    moe = ModelInfo.from_dict({"model_path": "/m", "weight_version": 2, "num_hidden_layers": 4,
                               "num_local_experts": 8, "num_experts_per_tok": 2})
    assert moe.moe_layout == (4, 2) and moe.weight_version == 2
    sglang = ModelInfo.from_dict({"model_path": "/m", "weight_version": "default"})
    assert sglang.moe_layout is None and sglang.weight_version == 0


def test_client_implements_the_protocol():
    from training.engines.client import RolloutClient

    assert isinstance(RolloutClient(["http://127.0.0.1:1"]), RolloutEngine)
