"""Evaluate a model on a task: batched generation with a KV cache, reward, accuracy per difficulty.

This is the trainer-side reference generator (fp32 by default, whatever dtype the model has):
prompts of a batch are left-padded, prefilled in one forward, then decoded one token per step
from the KV cache; a row stops at <eos> (finish reason ``stop``) or after ``max_new_tokens``
(``length``), and finished rows leave the batch so the long tail of long responses does not pay
for the short ones. Greedy decoding (temperature 0) is the default; with ``temperature > 0`` the
next token is sampled from softmax(logits / temperature) with a seeded generator.

Accuracy is the mean reward (rewards are 0/1 for the built-in verifiers) over the examples, overall
and per difficulty bucket.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from training.engines.model import CausalLM, KVCache
from training.tasks.registry import Example, Split, Task
from training.tasks.tokenizer import CharTokenizer
from training.tasks.tools import ToolTask


@dataclass(frozen=True)
class Generation:
    """One generated response.

    tokens: the response token ids, without the stop token.
    finish_reason: ``"stop"`` (the model wrote <eos>) or ``"length"`` (cut at max_new_tokens).
    """

    tokens: list[int]
    finish_reason: str


@dataclass(frozen=True)
class BucketResult:
    """Accuracy of one difficulty bucket (or of all examples)."""

    n: int
    accuracy: float
    mean_response_tokens: float
    truncated_fraction: float


@dataclass
class EvalResult:
    """What :func:`evaluate` measured.

    overall: all examples together.
    per_difficulty: one entry per difficulty (examples without a difficulty are only in overall).
    samples: (example, response text, reward) for every example, in evaluation order.
    """

    overall: BucketResult
    per_difficulty: dict[int, BucketResult]
    samples: list[tuple[Example, str, float]] = field(default_factory=list, repr=False)

    @property
    def accuracy(self) -> float:
        return self.overall.accuracy

    def table(self) -> list[dict[str, Any]]:
        """Rows ``{difficulty, n, accuracy, mean_response_tokens, truncated_fraction}``; the last
        row is ``difficulty="all"``. JSON-serialisable (stored in checkpoint metadata)."""
        rows = [{"difficulty": d, **vars(b)} for d, b in sorted(self.per_difficulty.items())]
        return [*rows, {"difficulty": "all", **vars(self.overall)}]


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (B, P), attention_mask (B, P)) with prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def _select_rows(cache: KVCache, rows: torch.Tensor) -> None:
    for layer in range(len(cache.k)):
        cache.k[layer] = cache.k[layer][rows]
        cache.v[layer] = cache.v[layer][rows]


@torch.no_grad()
def generate(
    model: CausalLM,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int = 0,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_token_ids: Sequence[int] = (),
) -> list[Generation]:
    """Generate a response for every prompt (one batch).

    Args:
        model: the model (its dtype is used as is; call ``model.eval()`` beforehand if needed).
        prompts: token ids, each starting with <bos>; lengths may differ (left padding).
        max_new_tokens: the longest response.
        eos_token_id: the stop token (not included in ``Generation.tokens``).
        pad_token_id: the id used for left padding.
        temperature: 0 for greedy (argmax), else sampling from softmax(logits / temperature).
        generator: the RNG for sampling (seed it for reproducible samples).
        stop_token_ids: more tokens that end a response (finish reason ``stop``) and, unlike
            <eos>, are kept in ``Generation.tokens`` (a tool call's closing character).
    Returns:
        one :class:`Generation` per prompt, in the input order.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (<bos>)")
    input_ids, mask = _left_pad(prompts, pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = KVCache(model.config.num_layers)
    logits, _ = model(input_ids, positions=positions, attention_mask=mask, cache=cache)
    last = logits[:, -1]
    next_pos = positions[:, -1] + 1
    active = torch.arange(len(prompts))  # original row of each batch row
    out: list[list[int]] = [[] for _ in prompts]
    finish = ["length"] * len(prompts)
    for step in range(max_new_tokens):
        if temperature == 0:
            token = last.argmax(-1)
        else:
            probs = torch.softmax(last.float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        stopped = token == eos_token_id
        for extra in stop_token_ids:
            stopped = stopped | (token == extra)
        for row, tok, stop in zip(active.tolist(), token.tolist(), stopped.tolist(), strict=True):
            if tok != eos_token_id:
                out[row].append(tok)
            if stop:
                finish[row] = "stop"
        keep = (~stopped).nonzero(as_tuple=True)[0]
        if keep.numel() == 0 or step == max_new_tokens - 1:
            break
        if keep.numel() < active.numel():
            active, token, mask, next_pos = active[keep], token[keep], mask[keep], next_pos[keep]
            _select_rows(cache, keep)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits, _ = model(token[:, None], positions=next_pos[:, None], attention_mask=mask,
                          cache=cache)
        last = logits[:, -1]
        next_pos = next_pos + 1
    return [Generation(tokens=t, finish_reason=f) for t, f in zip(out, finish, strict=True)]


def generate_trajectories(model: CausalLM, tokenizer: CharTokenizer, task: ToolTask,
                          prompts: list[list[int]], *, max_new_tokens: int, max_turns: int,
                          temperature: float = 0.0, generator: torch.Generator | None = None,
                          tool_timeout_s: float = 2.0) -> list[Generation]:
    """Tool trajectories for ``prompts`` (one batch), as the rollouter's agent loop makes them:
    each turn is generated for the rows still going until <eos> or a call's closing character;
    a call is run (:meth:`ToolTask.observe`) and its observation appended; a row stops at <eos>
    (``stop``), at ``max_new_tokens`` tokens in all or when its ``max_turns``-th turn ends in a
    call (``length``). ``Generation.tokens`` hold the whole trajectory, observations included."""
    close = tokenizer.encode(task.call_close)[0]
    outs: list[list[int]] = [[] for _ in prompts]
    finish = ["length"] * len(prompts)
    active = list(range(len(prompts)))
    for turn in range(max_turns):
        room = max(max_new_tokens - len(outs[i]) for i in active)
        gens = generate(model, [prompts[i] + outs[i] for i in active], max_new_tokens=room,
                        eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, temperature=temperature,
                        generator=generator, stop_token_ids=(close,))
        going = []
        for row, gen in zip(active, gens, strict=True):
            turn_start = len(outs[row])
            outs[row] += gen.tokens
            called = gen.finish_reason == "stop" and bool(gen.tokens) and gen.tokens[-1] == close
            if len(outs[row]) > max_new_tokens:  # a longer row's room: past this row's limit
                outs[row] = outs[row][:max_new_tokens]
                finish[row] = "length"
            elif called:
                if turn + 1 == max_turns or len(outs[row]) >= max_new_tokens:
                    finish[row] = "length"
                    continue
                obs = task.observe(tokenizer.decode(outs[row][turn_start:]), tool_timeout_s)
                outs[row] = (outs[row] + tokenizer.encode(obs.observation))[:max_new_tokens]
                if len(outs[row]) >= max_new_tokens:
                    finish[row] = "length"
                else:
                    going.append(row)
            else:
                finish[row] = gen.finish_reason
        active = going
        if not active:
            break
    return [Generation(tokens=t, finish_reason=f) for t, f in zip(outs, finish, strict=True)]


def _bucket(rewards: list[float], lengths: list[int], truncated: list[bool]) -> BucketResult:
    n = len(rewards)
    return BucketResult(n=n, accuracy=sum(rewards) / n, mean_response_tokens=sum(lengths) / n,
                        truncated_fraction=sum(truncated) / n)


@torch.no_grad()
def evaluate(
    model: CausalLM,
    tokenizer: CharTokenizer,
    task: Task,
    split: Split = "eval",
    n: int = 400,
    *,
    batch_size: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    max_new_tokens: int | None = None,
    max_turns: int = 8,
) -> EvalResult:
    """Accuracy of ``model`` on ``n`` examples of ``task``'s ``split``, overall and per difficulty.

    Args:
        model / tokenizer: the policy and its tokenizer.
        task: the task (its reward scores each decoded response).
        split: ``eval`` (default) or ``train``.
        n: examples to evaluate (``task.examples(split, n)``).
        batch_size: prompts generated together (grouped by prompt length).
        temperature: 0 = greedy; > 0 samples with ``torch.Generator().manual_seed(seed)``.
        max_new_tokens: response limit; default ``task.max_response_chars() + 1`` (room for <eos>).
            For a tool task it caps the trajectory (turns and observations together).
        max_turns: tool tasks: most model turns per trajectory (:func:`generate_trajectories`).
    """
    examples = task.examples(split, n)
    if not examples:
        raise ValueError(f"task {task.name!r} has no {split} examples to evaluate")
    limit = max_new_tokens or task.max_response_chars() + 1
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    prompts = [tokenizer.encode(ex.prompt, add_bos=True) for ex in examples]
    order = sorted(range(len(examples)), key=lambda i: len(prompts[i]))
    gens: dict[int, Generation] = {}
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        if isinstance(task, ToolTask):
            batch = generate_trajectories(model, tokenizer, task, [prompts[i] for i in idx],
                                          max_new_tokens=limit, max_turns=max_turns,
                                          temperature=temperature, generator=generator)
        else:
            batch = generate(model, [prompts[i] for i in idx], max_new_tokens=limit,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, temperature=temperature,
                             generator=generator)
        gens.update(zip(idx, batch, strict=True))
    model.train(was_training)

    samples, by_diff = [], defaultdict(list)
    for i, ex in enumerate(examples):
        text = tokenizer.decode(gens[i].tokens)
        reward = task.reward(ex, text)
        samples.append((ex, text, reward))
        record = (reward, len(gens[i].tokens), gens[i].finish_reason == "length")
        by_diff[ex.difficulty].append(record)
    every = [r for records in by_diff.values() for r in records]
    per = {d: _bucket(*map(list, zip(*records, strict=True)))
           for d, records in by_diff.items() if d is not None}
    return EvalResult(overall=_bucket(*map(list, zip(*every, strict=True))),
                      per_difficulty=per, samples=samples)
