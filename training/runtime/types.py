"""What flows through the runtime: samples and groups (seed 002's "sample" unit).

A :class:`Sample` is one response to one prompt with everything the trainer needs to correct for
how it was produced: behaviour (rollout-engine) log-probs, the trainer weight version that produced
each token (a partial rollout spans a weight sync, so versions can differ inside one sample),
routed experts for R3, the loss mask, the reward and timings. A :class:`Group` is the n samples of
one prompt (the GRPO group); groups are numbered in submission order (``group_id``).

Everything here is plain data (lists, numpy arrays, floats) so it pickles cheaply between Ray
actors and serialises to disk for resume (:meth:`Group.to_json` / :meth:`Group.from_json`).
"""

from __future__ import annotations

import base64
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["Group", "Sample"]


@dataclass
class Sample:
    """One response.

    group_id: submission-order index of its group.
    sample_index: position in the group (0 = the length-aware probe).
    prompt_id: the task example's stable id.
    prompt_ids: prompt token ids (starting with <bos>).
    response_ids: generated ids (ending with <eos> unless truncated).
    rollout_log_probs: (O,) log-probs the rollout engine sampled each response token with (μ).
    token_versions: (O,) trainer weight version that produced each response token.
    loss_mask: (O,) 1 = the token counts in the loss.
    reward: scalar reward of the response.
    difficulty: the example's difficulty bucket (None if the task has none).
    finish_reason: "stop" | "length" | "abort".
    routes: (P + O − 1, L, k) int32 routed experts from the rollout engine (MoE + R3), or None.
    engine_url: which engine produced (most of) it.
    submitted_at / finished_at: wall-clock times (time.time()).
    attempts: sends of the request (> 1 when an engine died and the router retried it).
    """

    group_id: int
    sample_index: int
    prompt_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    token_versions: list[int]
    loss_mask: list[int]
    reward: float
    difficulty: int | None = None
    finish_reason: str = "stop"
    routes: np.ndarray | None = None
    engine_url: str | None = None
    submitted_at: float = 0.0
    finished_at: float = 0.0
    attempts: int = 1

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def min_version(self) -> int:
        return min(self.token_versions) if self.token_versions else 0

    @property
    def spans_sync(self) -> bool:
        """True for a partial rollout: its tokens came from more than one weight version."""
        return len(set(self.token_versions)) > 1

    def finite(self) -> bool:
        """Reward and every counted log-prob are finite numbers."""
        if not math.isfinite(self.reward):
            return False
        return all(math.isfinite(lp) for lp, m in zip(self.rollout_log_probs, self.loss_mask,
                                                      strict=True) if m)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.routes is not None:
            r = np.ascontiguousarray(self.routes, dtype=np.int32)
            d["routes"] = {"shape": list(r.shape), "b64": base64.b64encode(r.tobytes()).decode()}
        # json cannot hold NaN/inf portably: keep them as strings
        d["reward"] = _num(self.reward)
        d["rollout_log_probs"] = [_num(x) for x in self.rollout_log_probs]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        r = d.get("routes")
        if r is not None:
            d["routes"] = np.frombuffer(base64.b64decode(r["b64"]), dtype=np.int32).reshape(
                r["shape"]).copy()
        d["reward"] = float(d["reward"])
        d["rollout_log_probs"] = [float(x) for x in d["rollout_log_probs"]]
        return cls(**d)


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


@dataclass
class Group:
    """The n samples of one prompt.

    group_id: submission order (0, 1, 2, ...).
    prompt_id / difficulty: the task example.
    answer: the example's reference answer (for the record).
    submit_step: the trainer step the rollouter was at when it submitted the group.
    samples: the n samples, ordered by ``sample_index``.
    completed_at: when the last sample finished.
    """

    group_id: int
    prompt_id: str
    difficulty: int | None
    answer: str
    submit_step: int
    samples: list[Sample] = field(default_factory=list)
    completed_at: float = 0.0

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def min_version(self) -> int:
        return min(s.min_version for s in self.samples) if self.samples else 0

    @property
    def partial(self) -> bool:
        return any(s.spans_sync for s in self.samples)

    def finite(self) -> bool:
        return all(s.finite() for s in self.samples)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "samples"}
        d["samples"] = [s.to_json() for s in self.samples]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Group:
        d = dict(d)
        d["samples"] = [Sample.from_json(s) for s in d["samples"]]
        return cls(**d)
