"""``rollouts.jsonl``: a bounded sample of the trajectories a run trained on, for people to read
beside the curves (the dashboard's Rollouts panel).

Each trained step the learner picks :data:`~training.runtime.learner.TRACES_PER_STEP`
trajectories (:class:`~training.runtime.types.RolloutTrace`); the run writes them on one step in
:func:`trace_every` (at most :data:`MAX_TRACED_STEPS` steps a run), each cut to its first
:data:`MAX_TRACE_TOKENS` response tokens — a few hundred kB at most whatever the run's length.
One JSON line per trajectory: ``step``, ``why``, ``group_id``, ``sample_index``, ``reward``,
``finish_reason``, ``tool_calls``, ``prompt`` (text), ``cut`` (tokens left out) and ``tokens``:
``t`` (text), ``d`` (train–rollout |Δlogp|), ``w`` (IS weight), ``s`` (staleness) and ``obs``
(1 on a tool's observation tokens, which the loss masks). A resumed run keeps the lines of the
steps before its checkpoint (``truncate_history``), like ``metrics.jsonl``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.runtime.types import RolloutTrace

log = logging.getLogger(__name__)

ROLLOUTS_FILE = "rollouts.jsonl"
MAX_TRACED_STEPS = 100
MAX_TRACE_TOKENS = 512


def trace_every(total_steps: int) -> int:
    """Write traces on steps divisible by this: at most :data:`MAX_TRACED_STEPS` a run."""
    return max(1, math.ceil(total_steps / MAX_TRACED_STEPS))


@functools.cache
def _tokenizer() -> Any:
    from training.tasks.tokenizer import CharTokenizer

    return CharTokenizer()


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def trace_record(step: int, t: RolloutTrace) -> dict[str, Any]:
    """The JSON line of one trace (text decoded with the tasks' character tokenizer; special
    tokens such as ``<eos>`` shown)."""
    tok = _tokenizer()
    n = min(len(t.response_ids), MAX_TRACE_TOKENS)
    tokens = [{"t": tok.decode([t.response_ids[i]], skip_special_tokens=False),
               "d": _finite(t.dlogp[i]), "w": _finite(t.is_weight[i]),
               "s": t.staleness[i] if i < len(t.staleness) else None,
               "obs": int(t.loss_mask[i] == 0) if i < len(t.loss_mask) else 0}
              for i in range(n)]
    return {"step": int(step), "why": t.why, "group_id": t.group_id,
            "sample_index": t.sample_index, "reward": _finite(t.reward),
            "finish_reason": t.finish_reason, "tool_calls": t.tool_calls,
            "prompt": tok.decode(list(t.prompt_ids)), "cut": len(t.response_ids) - n,
            "tokens": tokens}


def append_traces(path: Path, step: int, traces: Sequence[RolloutTrace]) -> None:
    """Append the step's traces and flush them (a kill leaves at most a partial last line,
    which :func:`read_traces` skips). Never ends the run: a failure to write (a full disk) is a
    warning, non-finite numbers are written as null."""
    try:
        lines = "".join(json.dumps(trace_record(step, t), allow_nan=False) + "\n"
                        for t in traces)
        with open(path, "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, ValueError) as e:
        log.warning("could not write the step's rollout samples to %s: %s", path, e)


def read_traces(path: str | Path) -> list[dict[str, Any]]:
    """The trace lines of a ``rollouts.jsonl`` in file order ([] when there is none)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if isinstance(row, dict) and isinstance(row.get("tokens"), list):
            out.append(row)
    return out
