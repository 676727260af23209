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
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

__all__ = ["Group", "RolloutState", "RunCounters", "RunState", "Sample"]


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
    turn_ids: (O,) the model turn of each response token in a tool trajectory (0 = before the
        first tool observation); a tool's observation tokens carry the turn they answer. Empty
        for a single-turn response (every token turn 0).
    tool_calls / tool_errors / tool_timeouts: tool calls the trajectory made, and how many of
        them gave an error or ran out of time (their observation says so).
    old_log_probs: (O,) π_old of each response token — the trainer-side log-prob under the
        weight version that generated it — computed by the rollouter before that version left
        the engines (``old_logprob: interrupt``); 0.0 on tool observation tokens (loss mask 0).
        Empty: not computed (every other strategy).
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
    turn_ids: list[int] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    old_log_probs: list[float] = field(default_factory=list)

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

    @property
    def turns(self) -> int:
        """Model turns in the response (1 for a single-turn response)."""
        return max(self.turn_ids) + 1 if self.turn_ids else 1

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
        d["old_log_probs"] = [_num(x) for x in self.old_log_probs]
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
        d["old_log_probs"] = [float(x) for x in d.get("old_log_probs", [])]
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


@dataclass
class RolloutState:
    """The rollouter's resume state (``Rollouter.state``; ``rollouter`` in ``runtime.json``).

    next_group_id: the id the next submitted group gets.
    regenerate: groups submitted but not complete at the checkpoint, generated again on resume
        (same prompts, same ids).
    policy_step: the trainer step the staleness controller counts from (seed 004's i).
    controller / dispatcher: ``state_dict()`` of the staleness controller and the dispatcher
        (:mod:`training.runtime.pipeline`).
    """

    next_group_id: int
    regenerate: list[int]
    policy_step: int
    controller: dict[str, Any]
    dispatcher: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutState:
        """Read :meth:`to_json` (``regenerate`` and ``policy_step`` may be missing: written
        before they existed)."""
        return cls(next_group_id=int(data["next_group_id"]),
                   regenerate=sorted(int(g) for g in data.get("regenerate", [])),
                   policy_step=int(data.get("policy_step", 0)),
                   controller=dict(data["controller"]), dispatcher=dict(data["dispatcher"]))


@dataclass
class RunCounters:
    """A run's cumulative counters: persisted in ``runtime.json`` (so a resumed run continues
    them) and reported as ``run/<name>`` in its summary (:meth:`metrics`).

    Samples (seed 002: a *sample* is a prompt's group, a *trajectory* one response):
    ``trained_samples`` / ``trained_tokens`` trained on; ``dropped_stale_samples`` discarded as
    too stale; ``rejected_batches`` / ``rejected_samples`` refused by a batch guard;
    ``stale_samples_processed`` groups and ``stale_trajectories_processed`` responses trained
    on with staleness > 0. Seconds: ``wait_time_s`` the trainer waited for data,
    ``train_time_s`` trained, ``sync_time_s`` / ``sync_wait_s`` spent in and waiting for weight
    syncs, ``eval_time_s`` evaluating, ``wall_time_s`` the whole loop.
    """

    dropped_stale_samples: int = 0
    stale_samples_processed: int = 0
    stale_trajectories_processed: int = 0
    rejected_batches: int = 0
    rejected_samples: int = 0
    trained_samples: int = 0
    trained_tokens: int = 0
    wait_time_s: float = 0.0
    train_time_s: float = 0.0
    sync_time_s: float = 0.0
    sync_wait_s: float = 0.0
    eval_time_s: float = 0.0
    wall_time_s: float = 0.0

    @property
    def dropped_stale_frac(self) -> float:
        """Cumulative share of responses dropped as too stale (``max_off_policy_steps``) among
        those dropped or trained on: dropped ÷ (dropped + trained); 0 before either."""
        total = self.dropped_stale_samples + self.trained_samples
        return self.dropped_stale_samples / total if total else 0.0

    def metrics(self) -> dict[str, float]:
        """``run/<counter>`` for every counter, and ``run/trained_tokens_per_s`` once the loop
        has run."""
        out = {f"run/{k}": float(v) for k, v in asdict(self).items()}
        if self.wall_time_s:
            out["run/trained_tokens_per_s"] = self.trained_tokens / self.wall_time_s
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunCounters:
        """Read the ``counters`` of a ``runtime.json`` (names it lacks start at 0)."""
        kinds = {f.name: f.type for f in fields(cls)}
        return cls(**{k: (int(float(v)) if kinds[k] == "int" else float(v))
                      for k, v in data.items() if k in kinds})


@dataclass
class RunState:
    """A run's resume state at a checkpoint (``checkpoint/runtime.json``).

    step: trainer steps done; total_steps: the run's length when written.
    step_start_versions: the weight version each trainer step started from (the version clock,
        :func:`training.runtime.pipeline.step_of_version`).
    synced_versions: versions the engines were given (the trainer keeps snapshots of those that
        buffered samples may carry).
    consumed_samples: samples taken from the buffer (the staleness controller's count).
    counters: :class:`RunCounters`.
    rollouter: :class:`RolloutState`.
    init_dir: the HF directory the run started from (the warm start or the given checkpoint).
    recipe_identity: the recipe's hash without ``steps`` (a resume must match it);
        recipe_hash: its full hash.
    """

    step: int
    step_start_versions: list[int]
    synced_versions: list[int]
    consumed_samples: int
    counters: RunCounters
    rollouter: RolloutState
    init_dir: str
    recipe_identity: str
    recipe_hash: str
    total_steps: int

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rollouter": self.rollouter.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunState:
        """Read :meth:`to_json`; KeyError/TypeError/ValueError on a file that is not one."""
        return cls(step=int(data["step"]),
                   step_start_versions=[int(v) for v in data["step_start_versions"]],
                   synced_versions=[int(v) for v in data.get("synced_versions", [])],
                   consumed_samples=int(data["consumed_samples"]),
                   counters=RunCounters.from_json(data["counters"]),
                   rollouter=RolloutState.from_json(data["rollouter"]),
                   init_dir=str(data["init_dir"]), recipe_identity=str(data["recipe_identity"]),
                   recipe_hash=str(data.get("recipe_hash", "")),
                   total_steps=int(data.get("total_steps", data["step"])))


@dataclass(frozen=True)
class RolloutTrace:
    """One trained trajectory kept for people to read (``rollouts.jsonl`` of the run; the
    dashboard's Rollouts panel): its ids and reward, and per response token the train–rollout
    gap |log π_current − log μ|, the IS weight the correction applied (1 without one), the
    staleness (policy versions between the token's behaviour weights and the step's start) and
    the loss mask (0 on a tool's observation tokens). ``why``: the reason it was picked
    (``largest |Δlogp|`` or ``highest reward``)."""

    why: str
    group_id: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    reward: float
    finish_reason: str
    tool_calls: int
    dlogp: tuple[float, ...]
    is_weight: tuple[float, ...]
    staleness: tuple[int, ...]
    loss_mask: tuple[int, ...]
