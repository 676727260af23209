"""Multi-turn tool tasks (seed 004 source 5; seed 002's partial tool agent loop).

A :class:`ToolTask` is a task whose response is a *trajectory*: the model writes a tool call in a
fixed text format and stops at its closing character; the environment runs the tool and appends
the observation; the model goes on, and after the last observation writes the final answer and
<eos>. One character per token (:class:`~training.tasks.tokenizer.CharTokenizer`)::

    prompt      "47+38+15="
    turn 0      "[47+38]"        a tool call; the closing "]" is a stop token of the request
    observation "{85}"           written by the environment: not the policy's, loss_mask 0
    turn 1      "[85+15]"
    observation "{100}"
    turn 2      "100"            the final answer, then <eos>

Tools are plain Python functions looked up by name (:data:`TOOLS`), never ``eval`` of model text:
``calc`` parses ``a+b``, ``a-b`` or ``a*b`` of non-negative integers with a regular expression.
A tool runs in-process on a daemon thread with a time limit (:func:`execute_tool`); an error, a
malformed call or a timeout becomes an observation (``{error: ...}``, ``{timeout}``) the model
sees, never an exception in the rollouter.

The task ``calc_chain`` adds k numbers of 1..99 (difficulty k, 2 ≤ k ≤ 6 by default) by k − 1
calculator calls, each adding the next number to the previous result. Reward ``tool_answer``: 1 iff
the text after the last observation is one number equal to the sum (an outcome reward: a model that
adds without the tool scores too); ``format_weight`` w mixes in a format reward, reward =
(1 − w)·correct + w·well_formed, well_formed = every call parsed and the tool was used.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from training.algorithms.registry import Registry
from training.tasks.registry import (
    REWARDS,
    TASKS,
    Example,
    Split,
    Task,
    check_split,
    in_eval_split,
    parse_number,
    stable_hash,
)

__all__ = ["TOOLS", "CalcChainTask", "ToolOutcome", "ToolTask", "execute_tool", "split_turns"]

ToolFn = Callable[[str], str]
TOOLS: Registry[ToolFn] = Registry("tool")

CALL_OPEN, CALL_CLOSE = "[", "]"
OBS_OPEN, OBS_CLOSE = "{", "}"
_MAX_OBS_CHARS = 24

_CALC = re.compile(r"\s*(\d{1,9})\s*([-+*])\s*(\d{1,9})\s*")


class ToolError(ValueError):
    """A tool refused its input (the message becomes the observation)."""


@TOOLS.register("calc")
def calc(expression: str) -> str:
    """``a+b``, ``a-b`` or ``a*b`` of non-negative integers (at most 9 digits each), parsed with a
    regular expression (never evaluated as code)."""
    m = _CALC.fullmatch(expression)
    if m is None:
        raise ToolError("bad call")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


ToolStatus = Literal["ok", "error", "timeout"]


@dataclass(frozen=True)
class ToolOutcome:
    """What one tool call gave: the observation text the model sees next, and how it ended
    (``ok``, ``error`` — the tool raised or the call was malformed — or ``timeout``) and the
    seconds it ran."""

    observation: str
    status: ToolStatus
    seconds: float


def execute_tool(fn: ToolFn, argument: str, timeout_s: float) -> tuple[str | None, ToolStatus]:
    """Run ``fn(argument)`` on a daemon thread for at most ``timeout_s`` seconds.

    Returns (result, "ok"), (message, "error") when it raised, or (None, "timeout") — a thread that
    overruns is left to finish on its own (a daemon: it never holds up the process's exit).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = str(fn(argument))
        except Exception as e:  # a tool's failure is the model's observation, not a crash
            box["error"] = str(e) or type(e).__name__

    thread = threading.Thread(target=run, name="asyncrl-tool", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, "timeout"
    if "error" in box:
        return box["error"], "error"
    return box["result"], "ok"


def split_turns(response: str) -> tuple[list[str], str]:
    """(the tool-call texts, the final answer) of a decoded trajectory: the calls are the text
    between each ``[`` and its ``]``; the answer is the text after the last observation's ``}``
    (the whole response when there is none)."""
    calls = re.findall(r"\[([^\[\]{}]*)\]", response)
    answer = response.rsplit(OBS_CLOSE, 1)[-1] if OBS_CLOSE in response else response
    return calls, answer


class ToolTask(Task):
    """A task answered through tool calls (module docstring). Subclasses set ``name`` and
    ``tool`` and implement :meth:`examples` and :meth:`reference_turns`.

    The rollouter asks :attr:`call_close` (the stop character of a call) and :meth:`observe` (run
    the call a turn ended with); the warm start asks :meth:`reference_segments`.
    """

    multi_turn = True
    call_close = CALL_CLOSE

    def __init__(self, *, reward: str, seed: int = 0, tool: str = "calc",
                 format_weight: float = 0.0) -> None:
        if not 0.0 <= format_weight <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
        super().__init__(reward=reward, seed=seed)
        self.tool_name = tool
        self.tool_fn: ToolFn = TOOLS.get(tool)  # KeyError listing valid names
        self.format_weight = format_weight

    def call_argument(self, turn_text: str) -> str | None:
        """The tool argument of a turn that ended with ``]``: the text after its last ``[``
        (None when the turn has no ``[``)."""
        if not turn_text.endswith(CALL_CLOSE) or CALL_OPEN not in turn_text:
            return None
        return turn_text[turn_text.rindex(CALL_OPEN) + 1:-1]

    def observe(self, turn_text: str, timeout_s: float) -> ToolOutcome:
        """Run the call ``turn_text`` ends with; the observation is ``{result}``, ``{error: why}``
        or ``{timeout}`` (at most 24 characters between the braces)."""
        import time
        start = time.perf_counter()
        argument = self.call_argument(turn_text)
        if argument is None:
            result, status = "no call", "error"
        else:
            result, status = execute_tool(self.tool_fn, argument, timeout_s)
        text = ("timeout" if status == "timeout" else
                f"error: {result}" if status == "error" else str(result))
        return ToolOutcome(OBS_OPEN + text[:_MAX_OBS_CHARS] + OBS_CLOSE, status,
                           time.perf_counter() - start)

    def reference_turns(self, example: Example) -> list[tuple[str, str]]:
        """The warm start's target: (policy text, observation) per tool turn, and the final
        answer as a last pair with an empty observation."""
        raise NotImplementedError

    def reference_segments(self, example: Example) -> list[tuple[str, bool]]:
        """(text, trained) pieces of the warm start's target: the observations are not trained
        on (the environment writes them, as the RL loss masks them)."""
        out: list[tuple[str, bool]] = []
        for text, obs in self.reference_turns(example):
            out.append((text, True))
            if obs:
                out.append((obs, False))
        return out

    def reference_response(self, example: Example) -> str:
        return "".join(text for text, _ in self.reference_segments(example))

    def reward(self, example: Example, response: str) -> float:
        correct = float(self.reward_fn(response, example.answer))
        if self.format_weight == 0.0:
            return correct
        calls, _ = split_turns(response)
        well_formed = bool(calls) and all(_CALC.fullmatch(c) for c in calls)
        return (1.0 - self.format_weight) * correct + self.format_weight * float(well_formed)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tool": self.tool_name,
                "format_weight": self.format_weight}


@REWARDS.register("tool_answer")
def tool_answer(response: str, answer: str) -> float:
    """1 iff the text after the last tool observation (``}``) is one number equal to the answer
    (the whole response when it used no tool)."""
    _, final = split_turns(response)
    got, want = parse_number(final), parse_number(answer)
    return float(got is not None and want is not None and got == want)


@TASKS.register("calc_chain")
class CalcChainTask(ToolTask):
    """Add k numbers of 1..``max_value`` with k − 1 calculator calls; difficulty = k.

    Args:
        seed: decides the train/eval partition and every sampled batch.
        min_k, max_k: the range of k (inclusive), 2 <= min_k <= max_k <= 8.
        max_value: the largest number in a prompt (2..999).
        eval_fraction: share of prompts held out for eval (seeded hash of the numbers), (0, 0.5].
        reward: registered reward (default ``tool_answer``).
        tool: registered tool the calls go to (default ``calc``).
        format_weight: weight of the format reward in [0, 1] (default 0: outcome only).
    """

    name = "calc_chain"

    def __init__(self, *, seed: int = 0, min_k: int = 2, max_k: int = 4, max_value: int = 99,
                 eval_fraction: float = 0.2, reward: str = "tool_answer", tool: str = "calc",
                 format_weight: float = 0.0) -> None:
        if not 2 <= min_k <= max_k <= 8:
            raise ValueError(f"need 2 <= min_k <= max_k <= 8, got min_k={min_k}, max_k={max_k}")
        if not 2 <= max_value <= 999:
            raise ValueError(f"max_value must be in [2, 999], got {max_value}")
        if not 0.0 < eval_fraction <= 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5], got {eval_fraction}")
        super().__init__(reward=reward, seed=seed, tool=tool, format_weight=format_weight)
        self.min_k, self.max_k, self.max_value = min_k, max_k, max_value
        self.eval_fraction = eval_fraction

    def _is_eval(self, numbers: tuple[int, ...]) -> bool:
        return in_eval_split(_key(numbers), self.seed, self.eval_fraction)

    def examples(self, split: Split, n: int, *, seed: int = 0,
                 difficulty: int | None = None) -> list[Example]:
        """See :meth:`Task.examples`: ``eval`` is a fixed list per k (n // K each, the first
        n % K buckets one more; ``seed`` ignored), ``train`` a seeded batch over the buckets."""
        check_split(split)
        ks = self.difficulties() if difficulty is None else [difficulty]
        if difficulty is not None and difficulty not in self.difficulties():
            raise ValueError(f"difficulty {difficulty} is outside this task's k range "
                             f"[{self.min_k}, {self.max_k}]")
        if split == "eval":
            out = []
            for i, k in enumerate(ks):
                count = n // len(ks) + (i < n % len(ks))
                rng = random.Random(stable_hash("calc_chain/eval", self.seed, k))
                seen: dict[tuple[int, ...], None] = {}
                while len(seen) < count:
                    nums = self._draw(k, rng)
                    if self._is_eval(nums):
                        seen.setdefault(nums)
                out += [self._example(nums) for nums in seen]
            return out
        rng = random.Random(stable_hash("calc_chain/train", self.seed, seed, n, difficulty))
        batch_ks = [ks[i % len(ks)] for i in range(n)]
        rng.shuffle(batch_ks)
        out = []
        for k in batch_ks:
            while True:
                nums = self._draw(k, rng)
                if not self._is_eval(nums):
                    out.append(self._example(nums))
                    break
        return out

    def _draw(self, k: int, rng: random.Random) -> tuple[int, ...]:
        return tuple(rng.randint(1, self.max_value) for _ in range(k))

    @staticmethod
    def _example(nums: tuple[int, ...]) -> Example:
        return Example(id=f"calc_chain/{_key(nums)}", prompt="+".join(map(str, nums)) + "=",
                       answer=str(sum(nums)), difficulty=len(nums))

    def difficulties(self) -> list[int]:
        return list(range(self.min_k, self.max_k + 1))

    def reference_turns(self, example: Example) -> list[tuple[str, str]]:
        nums = [int(x) for x in example.prompt.rstrip("=").split("+")]
        turns, total = [], nums[0]
        for x in nums[1:]:
            turns.append((f"{CALL_OPEN}{total}+{x}{CALL_CLOSE}",
                          f"{OBS_OPEN}{total + x}{OBS_CLOSE}"))
            total += x
        turns.append((str(total), ""))
        return turns

    def max_response_chars(self) -> int:
        worst = (self.max_value,) * self.max_k
        return len(self.reference_response(self._example(worst)))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "min_k": self.min_k, "max_k": self.max_k,
                "max_value": self.max_value, "eval_fraction": self.eval_fraction}


def _key(numbers: tuple[int, ...]) -> str:
    return "-".join(map(str, numbers))
