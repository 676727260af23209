"""The calculator tool, the calc_chain tool task and its reward (hand-computed cases)."""

from __future__ import annotations

import time

import pytest
import torch

from training.engines.warmstart import IGNORE, collate
from training.recipe import RecipeError, recipe_from_dict
from training.tasks.registry import get_task
from training.tasks.tokenizer import CharTokenizer
from training.tasks.tools import TOOLS, calc, execute_tool, split_turns, tool_answer


def test_calc_parses_and_never_evaluates():
    assert calc("12+30") == "42"
    assert calc(" 7 * 6 ") == "42"
    assert calc("50-8") == "42"
    for bad in ("__import__('os')", "1+2+3", "2**8", "1/0", "", "+"):
        with pytest.raises(ValueError, match="bad call"):
            calc(bad)


def test_execute_tool_ok_error_and_timeout():
    assert execute_tool(calc, "2+2", 1.0) == ("4", "ok")
    assert execute_tool(calc, "2/2", 1.0) == ("bad call", "error")
    start = time.perf_counter()
    assert execute_tool(lambda a: time.sleep(5), "x", 0.05) == (None, "timeout")
    assert time.perf_counter() - start < 1.0  # the caller does not wait for the tool


def test_observation_of_a_call_an_error_and_a_timeout():
    task = get_task("calc_chain")
    ok = task.observe("[47+38]", 1.0)
    assert (ok.observation, ok.status) == ("{85}", "ok")
    assert task.observe("xx[1/2]", 1.0).observation == "{error: bad call}"
    assert task.observe("no bracket]", 1.0).observation == "{error: no call}"

    @TOOLS.register("test_sleepy")
    def sleepy(argument: str) -> str:
        time.sleep(2)
        return "late"

    slow = get_task("calc_chain", tool="test_sleepy")
    out = slow.observe("[1+1]", 0.05)
    assert (out.observation, out.status) == ("{timeout}", "timeout")
    assert out.seconds < 1.0


def test_reference_trajectory_segments_and_reward():
    task = get_task("calc_chain", min_k=3, max_k=3)
    ex = task._example((47, 38, 15))
    assert ex.prompt == "47+38+15=" and ex.answer == "100" and ex.difficulty == 3
    assert task.reference_segments(ex) == [("[47+38]", True), ("{85}", False),
                                           ("[85+15]", True), ("{100}", False), ("100", True)]
    full = task.reference_response(ex)
    assert full == "[47+38]{85}[85+15]{100}100"
    assert task.reward(ex, full) == 1.0
    assert task.reward(ex, "[47+38]{85}[85+15]{100}99") == 0.0
    assert task.reward(ex, "100") == 1.0  # an outcome reward: answering without the tool counts
    assert split_turns(full) == (["47+38", "85+15"], "100")
    assert tool_answer("[1+1]{2}2 ", "2") == 1.0
    shaped = get_task("calc_chain", min_k=3, max_k=3, format_weight=0.2)
    assert shaped.reward(ex, full) == pytest.approx(1.0)
    assert shaped.reward(ex, "100") == pytest.approx(0.8)  # no tool call: format 0
    assert shaped.reward(ex, "[47+38]{85}7") == pytest.approx(0.2)
    # the longest reference of 3 terms: 99+99+99
    assert task.max_response_chars() == len("[99+99]{198}[198+99]{297}297")


def test_splits_are_disjoint_and_deterministic():
    task = get_task("calc_chain", seed=3)
    ev = task.examples("eval", 30)
    assert [e.difficulty for e in ev] == [2] * 10 + [3] * 10 + [4] * 10
    assert ev == task.examples("eval", 30)
    train = task.examples("train", 200, seed=1)
    assert train == task.examples("train", 200, seed=1)
    assert not {e.id for e in ev} & {e.id for e in train}
    with pytest.raises(ValueError, match="outside"):
        task.examples("train", 1, difficulty=7)
    with pytest.raises(KeyError, match="unknown tool 'nope'"):
        get_task("calc_chain", tool="nope")


def test_warm_start_targets_mask_the_observations():
    tok = CharTokenizer()
    ids, labels = collate(tok, ["1+2="], [[("[1+2]", True), ("{3}", False), ("3", True)]])
    prompt = tok.encode("1+2=", add_bos=True)
    text = "[1+2]{3}3"
    assert ids[0].tolist() == prompt + tok.encode(text)
    # logits at position t predict labels[t]: the prompt's last position predicts "["
    want = [IGNORE] * (len(prompt) - 1) + tok.encode("[1+2]") + [IGNORE] * 3 + tok.encode("3") \
        + [tok.eos_token_id]
    assert labels[0].tolist() == want
    plain_ids, plain_labels = collate(tok, ["1+2="], [text])
    assert torch.equal(plain_ids, ids) and (plain_labels != IGNORE).sum() == len(text) + 1


def test_turn_options_are_refused_with_other_estimators():
    recipe_from_dict({"algorithm": {"turns": {"advantage": "turn", "is_ratio": "turn"}}})
    with pytest.raises(RecipeError, match=r"per-turn GRPO baseline; set advantage\.estimator"):
        recipe_from_dict({"algorithm": {"advantage": {"estimator": "rloo"},
                                        "turns": {"advantage": "turn"}}})
