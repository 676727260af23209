import json

import pytest

from training.tasks.jsonl import JsonlError, JsonlTask, has_unknown_chars, load_jsonl
from training.tasks.registry import get_task


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def capitals(tmp_path):
    rows = [{"prompt": f"q{i}?", "answer": str(i * 3), "difficulty": i % 3} for i in range(40)]
    rows.append({"prompt": "q0?", "answer": "0", "difficulty": 0})  # duplicate prompt
    return write(tmp_path / "data.jsonl", rows)


def test_load_and_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "2+2=", "answer": 4}\n\n'
                    '{"prompt": "cap of FR?", "answer": "Paris", "difficulty": 2, "id": "fr", '
                    '"source": "ignored"}\n')
    a, b = load_jsonl(path)
    assert (a.id, a.prompt, a.answer, a.difficulty) == ("d:1", "2+2=", "4", None)
    assert (b.id, b.answer, b.difficulty) == ("fr", "Paris", 2)


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "a", "answer": "b"', "invalid JSON"),
    ('["a", "b"]', "expected a JSON object"),
    ('{"answer": "b"}', '"prompt" must be a non-empty string'),
    ('{"prompt": "a", "answer": null}', '"answer" must be a non-empty string'),
    ('{"prompt": "a", "answer": "b", "difficulty": "hard"}', '"difficulty" must be an integer'),
    ('{"prompt": "a", "answer": "b", "difficulty": true}', '"difficulty" must be an integer'),
])
def test_malformed_line_names_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "answer": "1"}\n' + line + "\n")
    with pytest.raises(JsonlError) as err:
        load_jsonl(path)
    message = str(err.value)
    assert message.startswith(f"{path}:2: ") and problem in message
    assert "\n" not in message


def test_missing_empty_and_non_utf8_files(tmp_path):
    with pytest.raises(JsonlError, match="no such file"):
        load_jsonl(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(JsonlError, match="holds no examples"):
        load_jsonl(tmp_path / "empty.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "x"}\n')
    with pytest.raises(JsonlError, match="not UTF-8"):
        load_jsonl(tmp_path / "latin1.jsonl")


def test_split_is_seeded_disjoint_and_keeps_duplicates_together(capitals):
    task = JsonlTask(path=capitals, seed=0, eval_fraction=0.25)
    eval_examples = task.examples("eval", 99)
    sizes = task.split_sizes()
    assert sizes["eval"] + sizes["train"] == 41 and sizes["eval"] == len(eval_examples)
    # the two lines of prompt "q0?" land in the same split
    assert sum(ex.prompt == "q0?" for ex in eval_examples) in (0, 2)
    ev = {ex.prompt for ex in eval_examples}
    tr = {ex.prompt for ex in task.examples("train", 500, seed=1)}
    assert len(ev) == 10 and len(tr) == 30 and not ev & tr
    again = JsonlTask(path=capitals, seed=0, eval_fraction=0.25)
    assert again.examples("eval", 99) == task.examples("eval", 99)
    assert again.examples("train", 16, seed=5) == task.examples("train", 16, seed=5)
    other = JsonlTask(path=capitals, seed=1, eval_fraction=0.25)
    assert {ex.prompt for ex in other.examples("eval", 99)} != ev


def test_train_batches_cover_the_pool_before_repeating(capitals):
    task = JsonlTask(path=capitals, eval_fraction=0.25)
    pool = task.split_sizes()["train"]
    batch = task.examples("train", pool, seed=3)
    assert len({ex.id for ex in batch}) == pool  # one full permutation
    assert task.examples("train", 7, seed=3, difficulty=1) and all(
        ex.difficulty == 1 for ex in task.examples("train", 7, seed=3, difficulty=1))
    assert task.difficulties() == [0, 1, 2]


def test_verifier_chosen_by_name(capitals):
    exact = get_task("jsonl", path=capitals)
    num = get_task("jsonl", path=capitals, reward="numeric")
    ex = exact.examples("eval", 1)[0]
    assert exact.reward(ex, ex.answer + ".0") == 0.0
    assert num.reward(ex, ex.answer + ".0") == 1.0
    assert num.reward(ex, "not a number") == 0.0
    with pytest.raises(KeyError, match="valid names"):
        get_task("jsonl", path=capitals, reward="regex")


def test_non_ascii_maps_to_unk_and_is_counted(tmp_path):
    path = write(tmp_path / "u.jsonl", [{"prompt": "café?", "answer": "oui"},
                                        {"prompt": "tea?", "answer": "yes"}])
    task = JsonlTask(path=path, eval_fraction=0.5)
    assert task.describe()["examples_with_unk"] == 1
    assert has_unknown_chars("café") and not has_unknown_chars("cafe\n")
    assert len(task.describe()["sha256"]) == 64


def test_needs_two_distinct_prompts(tmp_path):
    path = write(tmp_path / "one.jsonl", [{"prompt": "a", "answer": "b"}] * 3)
    with pytest.raises(JsonlError, match="at least 2 distinct prompts"):
        JsonlTask(path=path)
