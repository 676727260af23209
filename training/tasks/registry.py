"""Verifiable tasks and their rewards, each looked up by registered name.

A *task* hands out :class:`Example` s from two disjoint, seeded splits (``train`` and ``eval``) and
scores a response with a *reward function*. Both families are registries
(:class:`training.algorithms.registry.Registry`): a recipe names ``task: sum_digits`` and
``reward: exact_match`` and the code looks the names up — a recipe string is never evaluated, so a
recipe cannot run code. An unknown name raises a ``KeyError`` that lists the valid names.

Reward functions share one signature, ``reward(response, answer) -> float`` in [0, 1]: ``response``
is the decoded model output (without the stop token), ``answer`` the example's reference answer.
A malformed response scores 0; a reward function never raises on model output.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from training.algorithms import names
from training.algorithms.registry import Registry

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")

RewardFn = Callable[[str, str], float]
REWARDS: Registry[RewardFn] = Registry("reward function")
TASKS: Registry[Callable[..., Task]] = Registry("task")


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer.

    id: stable identifier (the same example has the same id in every run with the same seed).
    prompt: the text the model is conditioned on (encoded after <bos>).
    answer: the reference final answer the reward compares against.
    difficulty: an integer bucket for per-difficulty evaluation (e.g. the number of terms), or None.
    """

    id: str
    prompt: str
    answer: str
    difficulty: int | None = None


class Task(ABC):
    """A verifiable task: seeded disjoint train/eval splits and a reward looked up by name.

    Subclasses set ``name`` and implement :meth:`examples`; :meth:`reference_response` (the
    supervised target used by the warm start) defaults to the answer itself.
    """

    name: str = ""

    def __init__(self, *, reward: str, seed: int = 0) -> None:
        self.reward_name = reward
        self.reward_fn: RewardFn = REWARDS.get(reward)  # KeyError listing valid names
        self.seed = seed

    @abstractmethod
    def examples(self, split: Split, n: int, *, seed: int = 0,
                 difficulty: int | None = None) -> list[Example]:
        """``n`` examples of ``split`` (fewer only if the split holds fewer distinct ones).

        Deterministic in (task seed, split, n, seed, difficulty). ``eval`` returns distinct
        examples in a fixed order, spread evenly over the difficulties; ``train`` draws a batch for
        training (``seed`` picks the batch). ``difficulty`` restricts to one bucket.
        """

    def difficulties(self) -> list[int]:
        """The difficulty buckets this task reports (empty when it has none)."""
        return []

    def reference_response(self, example: Example) -> str:
        """The response a supervised warm start teaches for ``example`` (without the stop token)."""
        return example.answer

    def max_response_chars(self) -> int:
        """An upper bound on a correct response's length, for generation limits."""
        return 64

    def reward(self, example: Example, response: str) -> float:
        """Score ``response`` (decoded, without the stop token) against ``example.answer``."""
        return float(self.reward_fn(response, example.answer))

    def describe(self) -> dict[str, Any]:
        """The task's settings (JSON-serialisable): stored in checkpoint metadata and part of the
        warm start's cache key, so it must identify the data (a dataset task includes a hash)."""
        return {"name": self.name, "reward": self.reward_name, "seed": self.seed}


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    return split  # type: ignore[return-value]


BUILTIN_TASK_MODULES = ("training.tasks.sum_digits", "training.tasks.jsonl", "training.tasks.tools")


def load_builtin_tasks() -> None:
    """Import the modules whose decorators register the built-in tasks."""
    for module in BUILTIN_TASK_MODULES:
        importlib.import_module(module)


def task_names() -> list[str]:
    load_builtin_tasks()
    TASKS.require(names.TASKS)
    return TASKS.names()


def get_task(name: str, **kwargs: Any) -> Task:
    """Build the task registered as ``name`` (unknown name → KeyError listing the valid names).

    ``kwargs`` go to the task's constructor (e.g. ``seed``, ``min_k``/``max_k`` for sum_digits,
    ``path``/``reward`` for jsonl); a wrong keyword raises ``TypeError`` naming it.
    """
    load_builtin_tasks()
    return TASKS.get(name)(**kwargs)


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of ``parts`` that is the same in every process (unlike ``hash()``)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def in_eval_split(key: str, seed: int, eval_fraction: float) -> bool:
    """Whether the item ``key`` belongs to the eval split (a seeded hash threshold)."""
    return stable_hash("split", seed, key) < eval_fraction * 2**64


# ------------------------------------------------------------------------------------------------
# reward functions: reward(response, answer) -> float in [0, 1]
# ------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_NUMBER_LIST = re.compile(r"\d+(,\d+)*")


def parse_number(text: str) -> float | None:
    """``text`` (surrounding whitespace allowed) as a finite number, or None if it is not one."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def numbers_equal(a: float, b: float, rel_tol: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-12)


@REWARDS.register("exact_match")
def exact_match(response: str, answer: str) -> float:
    """1 iff the response equals the answer after stripping surrounding whitespace."""
    return float(response.strip() == answer.strip())


@REWARDS.register("numeric")
def numeric(response: str, answer: str) -> float:
    """1 iff the whole response is one number equal to the answer's (relative tolerance 1e-6).

    ``"17"``, ``" 17.0 "`` and ``"1.7e1"`` all match ``"17"``; ``"17 apples"`` does not (0).
    """
    got, want = parse_number(response), parse_number(answer)
    return float(got is not None and want is not None and numbers_equal(got, want))


@REWARDS.register("final_number")
def final_number(response: str, answer: str) -> float:
    """1 iff the response is a well-formed comma-separated list of non-negative integers whose
    last entry equals the answer (``"3,8,17"`` for answer ``"17"``); anything else scores 0.

    Only the final entry is checked: the intermediate entries (running totals in ``sum_digits``)
    are the model's working and are not rewarded on their own (an outcome reward).
    """
    text = response.strip()
    want = parse_number(answer)
    if want is None or not _NUMBER_LIST.fullmatch(text):
        return 0.0
    return float(numbers_equal(float(text.rsplit(",", 1)[-1]), want))
