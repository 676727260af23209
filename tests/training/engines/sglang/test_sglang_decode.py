"""The shared decoders (training.engines.rollout) against SGLang 0.5.x's documented /generate
answer: ``meta_info.output_token_logprobs`` = [logprob, token_id, text|null] per token,
``meta_info.routed_experts`` = ONE base64 string of row-major int32 bytes of shape
(prompt_len + output_len − 1 − routed_experts_start_len, num_layers, top_k), ``finish_reason``
objects, string ``weight_version``s. Payloads are built by hand (struct, literal base64), not by
asyncrl's own encoder.
"""

import base64
import struct

import numpy as np
import pytest

from training.engines.rollout import GenerateResult, RolloutEngineError, decode_routed_experts


def _b64_int32(values):
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()


def test_routed_experts_literal_base64_decodes_row_major():
    # 3 positions × 1 layer × top-2: [[1, 2]], [[3, 0]], [[7, 5]]
    routes = decode_routed_experts("AQAAAAIAAAADAAAAAAAAAAcAAAAFAAAA", num_layers=1, top_k=2)
    assert routes.dtype == np.int32 and routes.shape == (3, 1, 2)
    assert routes.tolist() == [[[1, 2]], [[3, 0]], [[7, 5]]]


def test_routed_experts_layers_are_the_middle_axis():
    # 2 positions × 2 layers × top-2, flat in C order: position-major, then layer, then k
    flat = [3, 1, 0, 2, 2, 3, 1, 0]
    routes = decode_routed_experts(_b64_int32(flat), num_layers=2, top_k=2)
    assert routes[0, 1].tolist() == [0, 2]  # position 0, layer 1
    assert routes[1, 0].tolist() == [2, 3]  # position 1, layer 0
    assert routes.reshape(-1).tolist() == flat


def test_a_full_sglang_answer_with_routed_experts_start_len():
    prompt, start, layers, k = [1, 9, 9, 4], 2, 2, 2
    out_ids = [5, 6, 2]
    rows = len(prompt) + len(out_ids) - 1 - start  # 4 positions whose next token was computed
    flat = list(range(rows * layers * k))
    answer = {  # as SGLang sends it with --skip-tokenizer-init (text empty, text null in lps)
        "text": "", "output_ids": out_ids,
        "meta_info": {
            "id": "9f1c", "prompt_tokens": 4, "completion_tokens": 3, "cached_tokens": 0,
            "e2e_latency": 0.05, "weight_version": "12",
            "finish_reason": {"type": "stop", "matched": 2},
            "input_token_logprobs": [[None, 4, None]],
            "output_token_logprobs": [[-0.6931, 5, None], [-1.25, 6, None], [-0.01, 2, None]],
            "routed_experts": _b64_int32(flat)}}
    r = GenerateResult.from_sglang(answer, prompt, moe_layout=(layers, k), engine_url="http://e")
    assert r.output_ids == [5, 6, 2]
    assert r.output_logprobs == [-0.6931, -1.25, -0.01]
    assert r.finish_reason == "stop" and r.finish_detail == {"type": "stop", "matched": 2}
    assert r.weight_version == 12 and r.output_token_weight_versions == [12, 12, 12]
    assert r.routed_experts.shape == (rows, layers, k)
    assert r.routed_experts[3, 1].tolist() == flat[-2:]
    assert r.rid == "9f1c" and r.text == "" and not r.aborted


def test_logprob_entries_with_text_and_length_finish():
    answer = {"text": "ab", "output_ids": [7, 8], "meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "weight_version": "default",
        "output_token_logprobs": [[-0.5, 7, "a"], [-2.0, 8, "b"]]}}
    r = GenerateResult.from_sglang(answer, [1])
    assert r.output_logprobs == [-0.5, -2.0] and r.finish_reason == "length"
    assert r.finish_detail["length"] == 2
    assert r.weight_version == 0  # SGLang's "default" before any update


def test_aborted_answer():
    answer = {"text": "", "output_ids": [3], "meta_info": {
        "finish_reason": {"type": "abort", "message": "Abort before prefill"},
        "weight_version": "2", "output_token_logprobs": [[-0.1, 3, None]]}}
    r = GenerateResult.from_sglang(answer, [1, 2])
    assert r.aborted and r.finish_detail["message"] == "Abort before prefill"


def test_weight_version_spans_give_each_token_its_version():
    # SGLang 0.5.23 (a request retracted across two weight updates): output token indices
    # [start, end) per version, the last span's version also in weight_version
    answer = {"output_ids": [5, 6, 7, 8, 9, 2], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "4",
        "weight_versions": [{"version": "2", "start": 0, "end": 2},
                            {"version": "3", "start": 2, "end": 5},
                            {"version": "4", "start": 5, "end": 6}]}}
    r = GenerateResult.from_sglang(answer, [1])
    assert r.output_token_weight_versions == [2, 2, 3, 3, 3, 4]
    assert r.weight_version == 4 and r.spans_weight_update
    # the first version may be SGLang's "default" (the launch version, asyncrl's 0)
    answer["meta_info"]["weight_versions"][0]["version"] = "default"
    assert GenerateResult.from_sglang(answer, [1]).output_token_weight_versions[:2] == [0, 0]
    # no spans (no update while it ran): every token has weight_version
    del answer["meta_info"]["weight_versions"]
    assert GenerateResult.from_sglang(answer, [1]).output_token_weight_versions == [4] * 6
    answer["meta_info"]["weight_versions"] = [{"version": "2"}]
    with pytest.raises(RolloutEngineError, match=r"not a list of \{version, start, end\} spans"):
        GenerateResult.from_sglang(answer, [1])


def test_logprobs_of_other_tokens_and_wrong_layouts_are_refused():
    bad = {"output_ids": [1, 2], "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 9, None]]}}
    with pytest.raises(RolloutEngineError, match="other tokens"):
        GenerateResult.from_sglang(bad, [1])
    with pytest.raises(RolloutEngineError, match="not a multiple"):
        decode_routed_experts(_b64_int32([1, 2, 3]), num_layers=1, top_k=2)
    with pytest.raises(RolloutEngineError, match="a label asyncrl did not give"):
        GenerateResult.from_sglang({"output_ids": [], "meta_info": {
            "weight_version": "step-3"}}, [1])
