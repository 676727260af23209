from collections import Counter

import pytest

from training.tasks.registry import get_task
from training.tasks.sum_digits import SumDigitsTask, format_prompt, format_response
from training.tasks.tokenizer import CharTokenizer


def test_format_is_running_totals_with_the_answer_last():
    assert format_prompt((3, 5, 9)) == "3+5+9="
    assert format_response((3, 5, 9)) == "3,8,17"
    assert format_response((7,)) == "7"
    task = SumDigitsTask()
    ex = task._example((3, 5, 9))
    assert (ex.prompt, ex.answer, ex.difficulty) == ("3+5+9=", "17", 3)
    assert task.reference_response(ex) == "3,8,17"
    assert task.reward(ex, task.reference_response(ex)) == 1.0
    # every character is a real token of the char tokenizer (no <unk>)
    tok = CharTokenizer()
    assert tok.unk_token_id not in tok.encode(ex.prompt + task.reference_response(ex))


def test_reward_right_wrong_malformed():
    task = SumDigitsTask()
    ex = task._example((9, 9, 9, 9))
    assert task.reward(ex, "9,18,27,36") == 1.0
    assert task.reward(ex, "9,18,27,35") == 0.0
    assert task.reward(ex, "9,18,26,36") == 1.0  # outcome reward: only the final total counts
    for malformed in ("", "9,18,27,", "9;18;27;36", "36<eos>", "9,18,27,36x"):
        assert task.reward(ex, malformed) == 0.0, malformed


def test_same_seed_same_examples_other_seed_other_examples():
    a, b, c = SumDigitsTask(seed=3), SumDigitsTask(seed=3), SumDigitsTask(seed=4)
    assert a.examples("train", 50, seed=7) == b.examples("train", 50, seed=7)
    assert a.examples("eval", 100) == b.examples("eval", 100)
    assert a.examples("train", 50, seed=7) != a.examples("train", 50, seed=8)
    assert a.examples("eval", 100) != c.examples("eval", 100)


def test_train_and_eval_are_disjoint():
    task = SumDigitsTask(seed=0)
    eval_prompts = {ex.prompt for ex in task.examples("eval", 2000)}
    train_prompts = {ex.prompt for s in range(20) for ex in task.examples("train", 256, seed=s)}
    assert eval_prompts and train_prompts and not eval_prompts & train_prompts
    # k = 1 and 2 are enumerated: exactly 20% of their prompts are held out
    assert sum(len(p) == 2 for p in eval_prompts) == 2
    assert sum(len(p) == 4 for p in eval_prompts) == 20
    assert all(task.is_eval(tuple(int(c) for c in p[:-1].split("+"))) for p in eval_prompts)


def test_eval_is_balanced_distinct_and_prefix_stable():
    task = SumDigitsTask(min_k=3, max_k=6)
    small, large = task.examples("eval", 40), task.examples("eval", 80)
    assert Counter(ex.difficulty for ex in small) == {3: 10, 4: 10, 5: 10, 6: 10}
    assert len({ex.id for ex in large}) == 80
    for k in (3, 4, 5, 6):
        s = [ex for ex in small if ex.difficulty == k]
        assert s == [ex for ex in large if ex.difficulty == k][:10]


def test_train_mix_and_difficulty_filter():
    task = SumDigitsTask(min_k=2, max_k=5)
    batch = task.examples("train", 40, seed=1)
    assert Counter(ex.difficulty for ex in batch) == {2: 10, 3: 10, 4: 10, 5: 10}
    only4 = task.examples("train", 10, seed=1, difficulty=4)
    assert {ex.difficulty for ex in only4} == {4}
    with pytest.raises(ValueError, match="outside this task's k range"):
        task.examples("train", 4, difficulty=9)
    with pytest.raises(ValueError, match="unknown split"):
        task.examples("test", 4)  # type: ignore[arg-type]


def test_config_validation_and_registry_construction():
    with pytest.raises(ValueError, match="min_k <= max_k"):
        SumDigitsTask(min_k=5, max_k=2)
    with pytest.raises(ValueError, match="eval_fraction"):
        SumDigitsTask(eval_fraction=0.0)
    task = get_task("sum_digits", seed=1, max_k=4)
    assert task.difficulties() == [1, 2, 3, 4]
    assert task.max_response_chars() == len("9,18,27,36")
    assert task.describe() == {"name": "sum_digits", "reward": "final_number", "seed": 1,
                               "min_k": 1, "max_k": 4, "eval_fraction": 0.2}
