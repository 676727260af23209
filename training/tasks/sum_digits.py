"""``sum_digits``: add k single-digit numbers, writing the running totals, answer last.

Format (one character per token with :class:`~training.tasks.tokenizer.CharTokenizer`)::

    prompt    "3+5+9="        the k digits joined by "+", then "="
    response  "3,8,17"        the running totals joined by ",", then <eos>; the last is the answer

For k = 1 the prompt is ``"7="`` and the response ``"7"``. A response has k totals, at most
2 characters each for k <= 11, so its length grows with k — the long tail of response lengths
that asynchronous RL must handle. Difficulty = k; accuracy falls with k (FACTS.md: a 0.8M-param
model after a warm start gets k=2 ≈ 1.0, k=4 ≈ 0.47, k>=6 ≈ 0.1).

Reward (``final_number``, see :mod:`training.tasks.registry`): 1 iff the response is a well-formed
comma-separated list of integers whose last entry equals the sum, else 0 — wrong intermediate
totals with a right final answer still score 1 (an outcome reward).

Splits: every prompt (the ordered digit tuple) belongs to exactly one split, decided by a seeded
hash, so train and eval never share a prompt. When k is small enough to enumerate (10**k <= 10**4)
exactly ``max(1, round(eval_fraction * 10**k))`` prompts of that k are held out (k = 1 keeps 2 of
its 10 prompts for eval at the default 0.2); for larger k each prompt is held out with probability
``eval_fraction``.
"""

from __future__ import annotations

import itertools
import random
from functools import cached_property
from typing import Any

from training.tasks.registry import (
    TASKS,
    Example,
    Split,
    Task,
    check_split,
    in_eval_split,
    stable_hash,
)

ENUMERATE_LIMIT = 10**4
MAX_K = 16


def format_prompt(digits: tuple[int, ...]) -> str:
    return "+".join(map(str, digits)) + "="


def running_totals(digits: tuple[int, ...]) -> list[int]:
    return list(itertools.accumulate(digits))


def format_response(digits: tuple[int, ...]) -> str:
    return ",".join(map(str, running_totals(digits)))


@TASKS.register("sum_digits")
class SumDigitsTask(Task):
    """Sum k single-digit numbers, k in [min_k, max_k]; difficulty = k.

    Args:
        seed: decides the train/eval partition and every sampled batch.
        min_k, max_k: the range of k (inclusive), 1 <= min_k <= max_k <= 16.
        eval_fraction: share of each k's prompts held out for eval, in (0, 0.5].
        reward: registered reward name (default ``final_number``).
    """

    name = "sum_digits"

    def __init__(self, *, seed: int = 0, min_k: int = 1, max_k: int = 8,
                 eval_fraction: float = 0.2, reward: str = "final_number") -> None:
        if not 1 <= min_k <= max_k <= MAX_K:
            raise ValueError(f"need 1 <= min_k <= max_k <= {MAX_K}, got min_k={min_k}, "
                             f"max_k={max_k}")
        if not 0.0 < eval_fraction <= 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5], got {eval_fraction}")
        super().__init__(reward=reward, seed=seed)
        self.min_k, self.max_k, self.eval_fraction = min_k, max_k, eval_fraction

    # --- split membership -----------------------------------------------------------------------
    @cached_property
    def _enumerated_eval(self) -> dict[int, list[tuple[int, ...]]]:
        """For each enumerable k, its eval prompts in a seeded (hash) order."""
        pools = {}
        for k in self.difficulties():
            if 10**k > ENUMERATE_LIMIT:
                continue
            ranked = sorted(itertools.product(range(10), repeat=k),
                            key=lambda d: stable_hash("split", self.seed, _key(d)))
            pools[k] = ranked[:max(1, round(self.eval_fraction * 10**k))]
        return pools

    @cached_property
    def _enumerated_eval_sets(self) -> dict[int, set[tuple[int, ...]]]:
        return {k: set(v) for k, v in self._enumerated_eval.items()}

    def is_eval(self, digits: tuple[int, ...]) -> bool:
        """Whether the prompt made of ``digits`` belongs to the eval split."""
        k = len(digits)
        if k in self._enumerated_eval_sets:
            return digits in self._enumerated_eval_sets[k]
        return in_eval_split(_key(digits), self.seed, self.eval_fraction)

    # --- examples -------------------------------------------------------------------------------
    def examples(self, split: Split, n: int, *, seed: int = 0,
                 difficulty: int | None = None) -> list[Example]:
        """See :meth:`Task.examples`. ``eval`` ignores ``seed``: the eval set is fixed by the task
        seed, n // K per k (the first n % K buckets get one more), each k's list a prefix of one
        fixed sequence (so a larger n extends a smaller one)."""
        check_split(split)
        ks = self._ks(difficulty)
        if split == "eval":
            counts = {k: n // len(ks) + (i < n % len(ks)) for i, k in enumerate(ks)}
            return [self._example(d) for k in ks for d in self._eval_digits(k, counts[k])]
        rng = random.Random(stable_hash("train", self.seed, seed, n, difficulty))
        batch_ks = [ks[i % len(ks)] for i in range(n)]
        rng.shuffle(batch_ks)
        return [self._example(self._train_digits(k, rng)) for k in batch_ks]

    def _ks(self, difficulty: int | None) -> list[int]:
        if difficulty is None:
            return self.difficulties()
        if difficulty not in self.difficulties():
            raise ValueError(f"difficulty {difficulty} is outside this task's k range "
                             f"[{self.min_k}, {self.max_k}]")
        return [difficulty]

    def _train_digits(self, k: int, rng: random.Random) -> tuple[int, ...]:
        while True:  # rejection: at most eval_fraction <= 0.5 of draws land in eval
            digits = tuple(rng.randrange(10) for _ in range(k))
            if not self.is_eval(digits):
                return digits

    def _eval_digits(self, k: int, count: int) -> list[tuple[int, ...]]:
        if k in self._enumerated_eval:
            return self._enumerated_eval[k][:count]
        rng = random.Random(stable_hash("eval", self.seed, k))
        seen: dict[tuple[int, ...], None] = {}
        while len(seen) < count:
            digits = tuple(rng.randrange(10) for _ in range(k))
            if self.is_eval(digits):
                seen.setdefault(digits)
        return list(seen)

    @staticmethod
    def _example(digits: tuple[int, ...]) -> Example:
        return Example(id=f"sum_digits/{_key(digits)}", prompt=format_prompt(digits),
                       answer=str(sum(digits)), difficulty=len(digits))

    # --- task interface -------------------------------------------------------------------------
    def difficulties(self) -> list[int]:
        return list(range(self.min_k, self.max_k + 1))

    def reference_response(self, example: Example) -> str:
        digits = tuple(int(c) for c in example.prompt.rstrip("=").split("+"))
        return format_response(digits)

    def max_response_chars(self) -> int:
        return len(format_response((9,) * self.max_k))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "min_k": self.min_k, "max_k": self.max_k,
                "eval_fraction": self.eval_fraction}


def _key(digits: tuple[int, ...]) -> str:
    return "".join(map(str, digits))
