"""``jsonl``: bring your own data — one JSON object per line, scored by a registered verifier.

Each non-blank line is ``{"prompt": str, "answer": str, "difficulty": int (optional),
"id": str (optional)}``; other keys are ignored, a numeric ``answer`` is read as its string
(``17`` → ``"17"``). The reward is looked up by name (``exact_match`` or ``numeric``, or any name in
:data:`~training.tasks.registry.REWARDS`); the warm start teaches the answer itself as the
response. A malformed line raises :class:`JsonlError` with one line naming the file and line number.

The embedded models use a character tokenizer over printable ASCII: any other character (accents,
CJK, emoji, tabs) becomes ``<unk>``, so such prompts or answers lose information —
``describe()["examples_with_unk"]`` counts the examples affected.

Split: the distinct prompts are ranked by a seeded hash and the first
``max(1, round(eval_fraction * distinct))`` are held out for eval, so train and eval never share
a prompt (duplicate lines of one prompt stay together) and the same seed gives the same split.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from training.tasks.registry import TASKS, Example, Split, Task, check_split, stable_hash
from training.tasks.tokenizer import CHARS

_KNOWN_CHARS = frozenset(CHARS)


class JsonlError(ValueError):
    """A JSONL dataset file is missing or malformed (the message names file, line and fix)."""


def load_jsonl(path: str | Path) -> list[Example]:
    """Parse a dataset file into examples (file order); raise :class:`JsonlError` on bad input."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JsonlError(f"{p}: no such file; pass the path of a .jsonl dataset") from None
    except IsADirectoryError:
        raise JsonlError(f"{p}: is a directory; pass the path of a .jsonl file") from None
    except UnicodeDecodeError as e:
        raise JsonlError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); save the file "
                         "as UTF-8") from None
    examples = [_parse_line(p, lineno, line)
                for lineno, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not examples:
        raise JsonlError(f"{p}: holds no examples; write one JSON object per line")
    return examples


def _parse_line(path: Path, lineno: int, line: str) -> Example:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise JsonlError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must "
                         "be one JSON object") from None
    if not isinstance(obj, dict):
        raise JsonlError(f"{where}: expected a JSON object with \"prompt\" and \"answer\", got "
                         f"{type(obj).__name__}")
    prompt, answer, difficulty = obj.get("prompt"), obj.get("answer"), obj.get("difficulty")
    if not isinstance(prompt, str) or not prompt:
        raise JsonlError(f"{where}: \"prompt\" must be a non-empty string")
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer:
        raise JsonlError(f"{where}: \"answer\" must be a non-empty string (or a number)")
    if difficulty is not None and (isinstance(difficulty, bool) or not isinstance(difficulty, int)):
        raise JsonlError(f"{where}: \"difficulty\" must be an integer when given, got "
                         f"{difficulty!r}")
    ex_id = obj.get("id")
    if ex_id is not None and not isinstance(ex_id, str | int):
        raise JsonlError(f"{where}: \"id\" must be a string or an integer when given")
    return Example(id=str(ex_id) if ex_id is not None else f"{path.stem}:{lineno}",
                   prompt=prompt, answer=answer, difficulty=difficulty)


def has_unknown_chars(text: str) -> bool:
    """Whether ``text`` holds characters the char tokenizer maps to <unk>."""
    return any(c not in _KNOWN_CHARS for c in text)


@TASKS.register("jsonl")
class JsonlTask(Task):
    """A dataset task over a JSONL file.

    Args:
        path: the dataset file.
        reward: registered reward name (``exact_match`` default, or ``numeric``).
        seed: decides the train/eval split and every sampled batch.
        eval_fraction: share of distinct prompts held out for eval, in (0, 0.5].
    """

    name = "jsonl"

    def __init__(self, *, path: str | Path, reward: str = "exact_match", seed: int = 0,
                 eval_fraction: float = 0.1) -> None:
        if not 0.0 < eval_fraction <= 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5], got {eval_fraction}")
        super().__init__(reward=reward, seed=seed)
        self.path, self.eval_fraction = Path(path), eval_fraction
        data = load_jsonl(self.path)
        prompts = sorted({ex.prompt for ex in data},
                         key=lambda s: stable_hash("split", seed, s))
        if len(prompts) < 2:
            raise JsonlError(f"{self.path}: needs at least 2 distinct prompts to split into "
                             "train and eval")
        held_out = set(prompts[:max(1, round(eval_fraction * len(prompts)))])
        order = {s: i for i, s in enumerate(prompts)}
        self._splits: dict[str, list[Example]] = {
            "eval": sorted((ex for ex in data if ex.prompt in held_out),
                           key=lambda ex: order[ex.prompt]),
            "train": [ex for ex in data if ex.prompt not in held_out],
        }
        self._sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        self._unk = sum(has_unknown_chars(ex.prompt + ex.answer) for ex in data)
        self._max_answer = max(len(ex.answer) for ex in data)

    def examples(self, split: Split, n: int, *, seed: int = 0,
                 difficulty: int | None = None) -> list[Example]:
        """See :meth:`Task.examples`: ``eval`` is the first ``n`` held-out examples in the split's
        fixed (hash) order; ``train`` draws ``n`` by concatenated seeded shuffles of the pool."""
        pool = self._splits[check_split(split)]
        if difficulty is not None:
            pool = [ex for ex in pool if ex.difficulty == difficulty]
        if split == "eval" or not pool:
            return pool[:n]
        rng = random.Random(stable_hash("train", self.seed, seed, n, difficulty))
        out: list[Example] = []
        while len(out) < n:
            out.extend(rng.sample(pool, len(pool)))
        return out[:n]

    def difficulties(self) -> list[int]:
        return sorted({ex.difficulty for split in self._splits.values() for ex in split
                       if ex.difficulty is not None})

    def max_response_chars(self) -> int:
        return self._max_answer

    def split_sizes(self) -> dict[str, int]:
        return {name: len(exs) for name, exs in self._splits.items()}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": str(self.path), "eval_fraction": self.eval_fraction,
                "sha256": self._sha256, "split_sizes": self.split_sizes(),
                "examples_with_unk": self._unk}
