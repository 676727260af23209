import pytest

from training.tasks.registry import (
    REWARDS,
    TASKS,
    Example,
    exact_match,
    final_number,
    get_task,
    numeric,
    parse_number,
    stable_hash,
    task_names,
)


def test_builtin_tasks_are_registered():
    assert {"sum_digits", "jsonl"} <= set(task_names())
    assert get_task("sum_digits").name == "sum_digits"


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(KeyError,
                       match=r"unknown task 'nope'; valid names: calc_chain, jsonl, sum_digits"):
        get_task("nope")
    with pytest.raises(KeyError,
                       match=r"valid names: exact_match, final_number, numeric, tool_answer"):
        REWARDS.get("eval('1')")
    with pytest.raises(KeyError, match="unknown reward function"):
        get_task("sum_digits", reward="__import__('os')")


def test_registering_another_task_under_a_taken_name_raises():
    with pytest.raises(ValueError, match="already registered"):
        TASKS.register("sum_digits")(lambda **kw: None)


def test_every_reward_scores_right_wrong_and_malformed():
    cases = {  # name: (right, wrong, malformed)
        "exact_match": (("17", "17"), ("18", "17"), ("", "17")),
        "numeric": ((" 17.0 ", "17"), ("16.9", "17"), ("17 apples", "17")),
        "final_number": (("3,8,17", "17"), ("3,8,18", "17"), ("3,8,", "17")),
        "tool_answer": (("[9+8]{17}17", "17"), ("[9+8]{17}18", "17"), ("[9+8]{17}", "17")),
    }
    assert set(cases) == set(REWARDS.names())
    for name, (right, wrong, malformed) in cases.items():
        fn = REWARDS.get(name)
        assert fn(*right) == 1.0, name
        assert fn(*wrong) == 0.0, name
        assert fn(*malformed) == 0.0, name


def test_exact_match_strips_only_surrounding_whitespace():
    assert exact_match(" Paris\n", "Paris") == 1.0
    assert exact_match("paris", "Paris") == 0.0


def test_numeric_parsing():
    assert parse_number("1.7e1") == 17.0 and parse_number("-3") == -3.0
    assert parse_number("1e999") is None and parse_number("nan") is None
    assert parse_number("1,000") is None
    assert numeric("1.7e1", "17") == 1.0
    assert numeric("17", "seventeen") == 0.0  # an unparsable answer never matches


def test_final_number_checks_only_the_last_total():
    assert final_number("3,9,17", "17") == 1.0  # wrong intermediate, right answer: outcome reward
    assert final_number("17", "17") == 1.0
    for bad in ("3,,17", "3, 8,17", "3,8,17,", "a", "3,8,1 7", "3.0,17.5", "-17"):
        assert final_number(bad, "17") == 0.0, bad


def test_task_reward_uses_the_registered_function():
    task = get_task("sum_digits")
    ex = Example(id="x", prompt="3+5+9=", answer="17", difficulty=3)
    assert task.reward(ex, "3,8,17") == 1.0 and task.reward(ex, "3,8,16") == 0.0


def test_stable_hash_is_fixed_across_processes():
    # 8-byte blake2b of "a\x1f1", little-endian: a constant, unlike the salted builtin hash()
    assert stable_hash("a", 1) == 0xC13CD84A6BC18181
    assert stable_hash("a", 2) != stable_hash("a", 1)
