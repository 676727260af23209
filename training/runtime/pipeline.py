"""Scheduling policies of the asynchronous rollout → trainer pipeline (pure Python, stdlib only).

Four decisions sit between the rollouter (which generates GRPO groups) and the trainer (which
consumes them), and each is specified by a seed:

* **Dispatch order** (:class:`Dispatcher`): the order in which individual sample requests go to the
  rollout engines. Seed 000, "Length-aware dispatch": response length is largely a property of the
  prompt, so only one sample of a group (the *probe*) is measured; it is sent at maximum priority,
  and when it completes the remaining n − 1 samples are queued longest-first. Probe lengths are
  cached per prompt with an EMA so later epochs skip the probe and dispatch all n at once.
* **Drain order** (:class:`GroupBuffer`): which completed groups the trainer takes. Seed 000,
  "Windowed FIFO drain": strict arrival order (naive FIFO) over-trains on easy, short prompts
  (simplicity bias); strict submission order blocks on the slowest sample; the compromise is a
  sliding window over submission order — only groups within ``window`` of the oldest unconsumed
  group (the *head*) are eligible, and the window advances as head groups are consumed.
* **Submission quota** (:class:`StalenessController`): how many samples the rollouter may submit.
  Seed 002 (verl fully-async, ``async_training.staleness_threshold``): between two parameter syncs
  the rollouter generates at most ``rollout_num = (1 + staleness_threshold) ·
  (trigger_parameter_sync_step · require_batches · ppo_mini_batch_size) − num_stale_samples``
  samples. Seed 004 ("Staleness rate-limiting", AReaL): a generation request is admitted only if
  ``⌊(N_r − 1) / B⌋ ≤ i + η``.
* **Staleness accounting** (:func:`steps_behind`, :func:`staleness_metrics`): how many policy steps
  old a consumed sample is, and the distribution logged per step.

Terminology: a *group* is one prompt × n samples (a GRPO group); groups get a 0-based ``group_id``
in submission order. A *step* is one trainer (global) step consuming ``groups_per_step`` groups,
i.e. ``B = groups_per_step · n`` samples. Policy versions are trainer step numbers (ints).

Nothing here talks to an engine, a queue or a clock: the classes are deterministic state machines
that the runtime drives, which keeps every policy unit-testable.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

__all__ = [
    "DISPATCH_MODES",
    "DRAIN_MODES",
    "Dispatcher",
    "GroupBuffer",
    "StalenessController",
    "staleness_metrics",
    "step_of_version",
    "steps_behind",
]

DISPATCH_MODES = ("fifo", "length_aware")
DRAIN_MODES = ("submission", "fifo", "windowed_fifo")

_TAKE_LOG_SIZE = 10_000

# Priority tiers of the dispatch heap (smaller pops first).
_TIER_REQUEUE = 0  # a failed request retried: the very front
_TIER_PROBE = 1  # seed 000: "sends the first sample of each prompt group as a probe at maximum
#                  priority" — ahead of every queued non-probe sample
_TIER_NORMAL = 2  # everything else: longer expected length first (fifo mode: submission order)


def _require_int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}; pass a whole number")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; pass {name} >= {minimum}")
    return value


# ---------------------------------------------------------------------------------------------
# Dispatch order (seed 000, length-aware dispatch)
# ---------------------------------------------------------------------------------------------


@dataclass
class _GroupState:
    """Bookkeeping of one group inside the :class:`Dispatcher` (forgotten once all n complete)."""

    prompt_key: str
    n: int
    seq: int  # submission order of the group (tie-break "ties by submission order")
    held: list[int] = field(default_factory=list)  # waiting for the probe (length_aware)
    queued: set[int] = field(default_factory=set)  # in the dispatch heap
    in_flight: set[int] = field(default_factory=set)  # popped, not completed
    completed: int = 0
    probe_outstanding: bool = False  # sample 0 is a probe whose length is not known yet


class Dispatcher:
    """Order in which individual sample requests ``(group_id, sample_index)`` go to the engines.

    Modes (``DISPATCH_MODES``):

    * ``"fifo"``: samples leave in submission order (group by group, sample 0..n−1).
    * ``"length_aware"`` (seed 000, "Length-aware dispatch"): when a group is added and its
      ``prompt_key`` has no cached expected length, only sample 0 is queued, as a *probe*, ahead of
      every queued non-probe sample (probes among themselves in submission order — the seed's
      ``heappush(queue, (float("-inf"), seq, ...))``); the other n − 1 are *held*. When the probe
      completes its response length L is cached and the held samples are queued at priority L.
      With a cached length L (seed: "subsequent epochs skip the probe entirely and dispatch all k
      samples immediately at the cached priority") all n are queued at once at priority L.
      Non-probe samples leave longest expected length first, ties by group submission order, then
      sample index — the seed's ``(-cached_len, seq, ...)`` heap key: "Longer (harder) prompts get
      dispatched earlier, giving them a head start so they're closer to completion when the window
      reaches them."

    In both modes a :meth:`requeue`-d sample (its request failed) goes back at the very front,
    ahead of probes; retried samples among themselves leave in requeue order. A requeued probe stays
    the group's probe.

    The expected-length cache is an EMA per ``prompt_key`` (seed 000: "Probe lengths are cached via
    EMA"): the first observation sets it, later ones give ``new = α·obs + (1 − α)·old``. Every
    completed sample updates it (probes and, in ``length_aware`` mode, the other samples too, so
    later epochs use a fresher estimate); in ``fifo`` mode the cache is kept for statistics only.
    Held samples are released at the probe's own observed length (for the first observation of a
    prompt that equals the cached value).
    """

    def __init__(self, mode: str = "length_aware", ema_alpha: float = 0.5) -> None:
        if mode not in DISPATCH_MODES:
            raise ValueError(f"unknown dispatch mode {mode!r}; use one of {DISPATCH_MODES}")
        if isinstance(ema_alpha, bool) or not isinstance(ema_alpha, int | float):
            raise ValueError(f"ema_alpha must be a number in (0, 1], got {ema_alpha!r}")
        if not 0.0 < float(ema_alpha) <= 1.0:
            raise ValueError(
                f"ema_alpha must be in (0, 1], got {ema_alpha}; pass e.g. ema_alpha=0.5 "
                "(1.0 keeps only the latest observation)"
            )
        self.mode = mode
        self.ema_alpha = float(ema_alpha)
        self._heap: list[tuple[int, float, int, int, int, int]] = []
        self._groups: dict[int, _GroupState] = {}
        self._cache: dict[str, float] = {}
        self._group_seq = 0
        self._requeue_seq = 0
        self._n_held = 0
        self._probes = 0
        self._cache_hits = 0

    # -- queue -----------------------------------------------------------------------------------

    def _push(self, tier: int, length: float, order: int, group_id: int, index: int) -> None:
        heapq.heappush(self._heap, (tier, -length, order, index, group_id, index))
        self._groups[group_id].queued.add(index)

    def add_group(self, group_id: int, prompt_key: str, n: int) -> None:
        """Queue the n sample requests of a newly submitted group (see the class docstring)."""
        _require_int("group_id", group_id, 0)
        _require_int("n", n, 1)
        if group_id in self._groups:
            raise ValueError(
                f"group {group_id} is already being dispatched; give every group a new group_id"
            )
        state = _GroupState(prompt_key=prompt_key, n=n, seq=self._group_seq)
        self._group_seq += 1
        self._groups[group_id] = state
        cached = self._cache.get(prompt_key)
        if cached is not None:
            self._cache_hits += 1
        if self.mode == "fifo":
            for i in range(n):
                self._push(_TIER_NORMAL, 0.0, state.seq, group_id, i)
        elif cached is None:
            # seed 000: probe sample[0] at maximum priority, hold the rest until it completes
            state.probe_outstanding = True
            self._probes += 1
            self._push(_TIER_PROBE, 0.0, state.seq, group_id, 0)
            state.held = list(range(1, n))
            self._n_held += n - 1
        else:
            # seed 000: cache hit — push all k samples at the cached priority
            for i in range(n):
                self._push(_TIER_NORMAL, cached, state.seq, group_id, i)

    def pop(self) -> tuple[int, int] | None:
        """The next ``(group_id, sample_index)`` to send, or ``None`` when nothing is ready."""
        if not self._heap:
            return None
        *_, group_id, index = heapq.heappop(self._heap)
        state = self._groups[group_id]
        state.queued.discard(index)
        state.in_flight.add(index)
        return group_id, index

    def _in_flight_state(self, group_id: int, sample_index: int, verb: str) -> _GroupState:
        state = self._groups.get(group_id)
        if state is None:
            raise ValueError(
                f"cannot {verb} sample ({group_id}, {sample_index}): group {group_id} is unknown "
                "(never added, or all its samples already completed); call add_group first"
            )
        if sample_index not in state.in_flight:
            raise ValueError(
                f"cannot {verb} sample ({group_id}, {sample_index}): it is not in flight "
                "(only samples returned by pop() and not yet completed/requeued can be)"
            )
        return state

    def complete(self, group_id: int, sample_index: int, response_len: int) -> None:
        """Record a finished sample: update the EMA cache, release held samples after a probe."""
        _require_int("response_len", response_len, 0)
        state = self._in_flight_state(group_id, sample_index, "complete")
        state.in_flight.discard(sample_index)
        state.completed += 1
        self._observe(state.prompt_key, float(response_len))
        if state.probe_outstanding and sample_index == 0:
            state.probe_outstanding = False
            for i in state.held:
                self._push(_TIER_NORMAL, float(response_len), state.seq, group_id, i)
            self._n_held -= len(state.held)
            state.held = []
        if state.completed == state.n:
            del self._groups[group_id]  # forget finished groups: no unbounded growth

    def requeue(self, group_id: int, sample_index: int) -> None:
        """Put a sample whose request failed back at the front of the queue."""
        state = self._in_flight_state(group_id, sample_index, "requeue")
        state.in_flight.discard(sample_index)
        self._push(_TIER_REQUEUE, 0.0, self._requeue_seq, group_id, sample_index)
        self._requeue_seq += 1

    # -- cache -----------------------------------------------------------------------------------

    def _observe(self, prompt_key: str, length: float) -> None:
        old = self._cache.get(prompt_key)
        a = self.ema_alpha
        self._cache[prompt_key] = length if old is None else a * length + (1.0 - a) * old

    def expected_length(self, prompt_key: str) -> float | None:
        """The cached EMA response length of ``prompt_key`` (``None`` if never observed)."""
        return self._cache.get(prompt_key)

    # -- introspection ---------------------------------------------------------------------------

    def pending(self) -> int:
        """Samples queued and ready to :meth:`pop` (held samples excluded)."""
        return len(self._heap)

    def held(self) -> int:
        """Samples held back until their group's probe completes."""
        return self._n_held

    def stats(self) -> dict[str, float]:
        """``dispatch/probes`` (probes issued), ``dispatch/cache_hits`` (groups added with a
        cached length), ``dispatch/cache_size`` (prompts with a cached length)."""
        return {
            "dispatch/probes": float(self._probes),
            "dispatch/cache_hits": float(self._cache_hits),
            "dispatch/cache_size": float(len(self._cache)),
        }

    def state_dict(self) -> dict[str, Any]:
        """The EMA cache and counters (JSON-serialisable). The queue itself is not persisted: on
        resume the runtime re-adds the groups it still needs."""
        return {
            "expected_len": dict(self._cache),
            "probes": self._probes,
            "cache_hits": self._cache_hits,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (queue and in-flight bookkeeping untouched)."""
        try:
            cache = {str(k): float(v) for k, v in dict(state["expected_len"]).items()}
            probes = _require_int("probes", state["probes"], 0)
            hits = _require_int("cache_hits", state["cache_hits"], 0)
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"not a Dispatcher state_dict ({exc!r}); pass the dict from Dispatcher.state_dict()"
            ) from exc
        self._cache = cache
        self._probes = probes
        self._cache_hits = hits


# ---------------------------------------------------------------------------------------------
# Drain order (seed 000, windowed FIFO drain)
# ---------------------------------------------------------------------------------------------


class GroupBuffer:
    """Drain policy of the sample buffer between rollouter and trainer.

    Items are opaque completed groups with an int ``group_id`` attribute. The buffer tracks every
    submitted group until it is *consumed* (:meth:`take`), *dropped* (:meth:`drop`) or *abandoned*
    (:meth:`abandon`); :attr:`head` is the smallest submitted id not yet in one of those states.

    Drain modes (``DRAIN_MODES``), for :meth:`take` ``(k)``:

    * ``"submission"``: the k oldest outstanding groups in submission order (head, head+1, …,
      head+k−1 when none of them was dropped/abandoned) must all be completed — the synchronous /
      one-step-off batch; blocks on the slowest sample.
    * ``"fifo"``: the first k in arrival order (seed 000's naive FIFO, which shows simplicity bias:
      easy prompts finish first and dominate the batches).
    * ``"windowed_fifo"`` (seed 000): only groups with ``group_id < head + window`` are eligible;
      eligible groups are taken in arrival order one at a time and head is re-evaluated after each
      removal, so the window slides as head groups are consumed. ``window=1`` is strict submission
      order, a window ≥ the number of outstanding groups is naive FIFO.

    A take is all-or-nothing: ``None`` (nothing removed) when fewer than k groups can be taken.
    Every taken group is logged as ``(group_id, head_before_taking_it)`` in :attr:`take_log` (the
    last 10,000), so the windowed invariant ``group_id < head + window`` is checkable.
    """

    def __init__(self, drain: str = "windowed_fifo", window: int = 16) -> None:
        if drain not in DRAIN_MODES:
            raise ValueError(f"unknown drain mode {drain!r}; use one of {DRAIN_MODES}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"window must be an int >= 1, got {window!r}; pass window >= 1 "
                "(1 = strict submission order)"
            )
        self.drain = drain
        self.window = window
        self._buffer: dict[int, Any] = {}  # completed groups, in arrival order
        self._outstanding: set[int] = set()  # submitted, not consumed/dropped/abandoned
        self._order: deque[int] = deque()  # submitted ids, oldest first (left lazily trimmed)
        self._last_id: int | None = None
        self._take_log: deque[tuple[int, int]] = deque(maxlen=_TAKE_LOG_SIZE)
        self._n_submitted = 0
        self._n_consumed = 0
        self._n_dropped = 0
        self._n_abandoned = 0

    # -- head ------------------------------------------------------------------------------------

    @property
    def _next_id(self) -> int:
        return 0 if self._last_id is None else self._last_id + 1

    def _head_excluding(self, excluded: set[int]) -> int:
        for gid in self._order:
            if gid in self._outstanding and gid not in excluded:
                return gid
        return self._next_id

    def _trim(self) -> None:
        while self._order and self._order[0] not in self._outstanding:
            self._order.popleft()

    @property
    def head(self) -> int:
        """Smallest submitted group id not yet consumed, dropped or abandoned (the next id to be
        submitted when none is outstanding)."""
        return self._order[0] if self._order else self._next_id

    def _finish(self, group_id: int) -> None:
        self._outstanding.discard(group_id)
        self._trim()

    # -- producer side ---------------------------------------------------------------------------

    def submitted(self, group_id: int) -> None:
        """The rollouter submitted ``group_id`` (ids strictly increasing)."""
        _require_int("group_id", group_id, 0)
        if self._last_id is not None and group_id <= self._last_id:
            raise ValueError(
                f"group ids must be submitted in strictly increasing order: got {group_id} after "
                f"{self._last_id}; submit {self._last_id + 1} or later"
            )
        self._last_id = group_id
        self._outstanding.add(group_id)
        self._order.append(group_id)
        self._n_submitted += 1

    def put(self, group: Any) -> None:
        """A completed group arrives (it must be outstanding and not already buffered)."""
        gid = getattr(group, "group_id", None)
        _require_int("group.group_id", gid, 0)
        if gid in self._buffer:
            raise ValueError(f"group {gid} is already buffered; put each group once")
        if gid not in self._outstanding:
            raise ValueError(
                f"group {gid} is not outstanding (never submitted, or already consumed, dropped "
                "or abandoned); call submitted(group_id) before put()"
            )
        self._buffer[gid] = group

    def abandon(self, group_id: int) -> None:
        """A submitted group that will never arrive (e.g. generation failed permanently)."""
        if group_id in self._buffer:
            raise ValueError(
                f"group {group_id} has arrived and is buffered; use drop() to discard it"
            )
        if group_id not in self._outstanding:
            raise ValueError(
                f"group {group_id} is not outstanding (never submitted, or already consumed, "
                "dropped or abandoned); only in-flight groups can be abandoned"
            )
        self._n_abandoned += 1
        self._finish(group_id)

    # -- consumer side ---------------------------------------------------------------------------

    def _plan(self, k: int) -> list[tuple[int, int]] | None:
        picked: list[tuple[int, int]] = []
        taken: set[int] = set()
        head = self.head
        if self.drain == "submission":
            for gid in self._order:
                if len(picked) == k:
                    break
                if gid not in self._outstanding:
                    continue
                if gid not in self._buffer:
                    return None  # blocked on the oldest incomplete group
                picked.append((gid, gid))  # each taken group is the head when taken
            return picked if len(picked) == k else None
        arrival = list(self._buffer)
        while len(picked) < k:
            limit = head + self.window if self.drain == "windowed_fifo" else None
            choice = next(
                (g for g in arrival if g not in taken and (limit is None or g < limit)), None
            )
            if choice is None:
                return None
            picked.append((choice, head))
            taken.add(choice)
            head = self._head_excluding(taken)  # the window slides as head groups are consumed
        return picked

    def take(self, k: int) -> list[Any] | None:
        """Remove and return k groups under the drain policy, or ``None`` (nothing removed) if k
        cannot be taken now."""
        _require_int("k", k, 1)
        plan = self._plan(k)
        if plan is None:
            return None
        out = []
        for gid, head_before in plan:
            out.append(self._buffer.pop(gid))
            self._take_log.append((gid, head_before))
            self._n_consumed += 1
            self._outstanding.discard(gid)
        self._trim()
        return out

    def drop(self, predicate: Callable[[Any], bool]) -> list[Any]:
        """Remove and return (in arrival order) every buffered group with ``predicate(group)``
        true, e.g. too stale; dropped groups count as consumed for :attr:`head`."""
        victims = [gid for gid, g in self._buffer.items() if predicate(g)]
        out = [self._buffer.pop(gid) for gid in victims]
        for gid in victims:
            self._outstanding.discard(gid)
        self._n_dropped += len(victims)
        self._trim()
        return out

    # -- introspection ---------------------------------------------------------------------------

    @property
    def take_log(self) -> tuple[tuple[int, int], ...]:
        """``(group_id, head_before_taking_it)`` of the last 10,000 taken groups."""
        return tuple(self._take_log)

    def __len__(self) -> int:
        return len(self._buffer)

    def outstanding(self) -> int:
        """Submitted − consumed − dropped − abandoned (= buffered + in flight)."""
        return len(self._outstanding)

    def buffered_ids(self) -> list[int]:
        """Ids of the buffered completed groups, in arrival order."""
        return list(self._buffer)

    def buffered(self) -> list[Any]:
        """The buffered completed groups themselves, in arrival order (not removed)."""
        return list(self._buffer.values())

    def state_dict(self) -> dict[str, Any]:
        """Counters, head and the outstanding ids (JSON-serialisable), not the groups: the caller
        persists buffered groups itself and re-:meth:`put`-s them after loading (in-flight groups
        that are lost must be re-put or :meth:`abandon`-ed)."""
        return {
            "head": self.head,
            "next_id": self._next_id,
            "outstanding_ids": sorted(self._outstanding),
            "submitted": self._n_submitted,
            "consumed": self._n_consumed,
            "dropped": self._n_dropped,
            "abandoned": self._n_abandoned,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into an empty buffer (buffered groups are cleared)."""
        try:
            next_id = _require_int("next_id", state["next_id"], 0)
            ids = sorted(_require_int("outstanding id", g, 0) for g in state["outstanding_ids"])
            counts = {
                k: _require_int(k, state[k], 0)
                for k in ("submitted", "consumed", "dropped", "abandoned")
            }
            head = _require_int("head", state["head"], 0)
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"not a GroupBuffer state_dict ({exc!r}); pass the dict from "
                "GroupBuffer.state_dict()"
            ) from exc
        if (ids and ids[-1] >= next_id) or head != (ids[0] if ids else next_id):
            raise ValueError(
                "inconsistent GroupBuffer state_dict (head/next_id/outstanding_ids disagree); "
                "pass an unmodified GroupBuffer.state_dict()"
            )
        self._buffer.clear()
        self._outstanding = set(ids)
        self._order = deque(ids)
        self._last_id = next_id - 1 if next_id > 0 else None
        self._take_log.clear()
        self._n_submitted = counts["submitted"]
        self._n_consumed = counts["consumed"]
        self._n_dropped = counts["dropped"]
        self._n_abandoned = counts["abandoned"]


# ---------------------------------------------------------------------------------------------
# Submission quota (seed 002 staleness_threshold, seed 004 max-ahead rate limit)
# ---------------------------------------------------------------------------------------------


def _exact(x: float) -> Fraction:
    """``x`` as the decimal it prints as, so ``ceil((1 + 0.1) · 10)`` is 11, not 12."""
    return Fraction(str(x))


class StalenessController:
    """How many samples the rollouter may submit now.

    Two independent rules, both enforced:

    * **Quota** (seed 002, verl ``async_training.staleness_threshold``): after every parameter sync
      (and at start) the rollouter may submit at most ::

          rollout_num = ceil((1 + staleness_threshold) · trigger_parameter_sync_step · B)
                        − num_stale_samples

      samples until the next sync, where ``B = samples_per_step`` (seed 002's ``require_batches ·
      ppo_mini_batch_size``) and ``num_stale_samples`` are the samples generated or in flight but
      not yet consumed at the sync (:meth:`on_sync`'s ``outstanding_samples``). With
      ``staleness_threshold=0`` this is synchronous training: exactly ``trigger_parameter_sync_step
      · B`` samples per sync. Never below 0. The ``ceil`` (an integer sample count for a fractional
      threshold) is ours; the threshold is taken as the decimal it prints as.
    * **Max-ahead** (seed 004, "Staleness rate-limiting"; off when ``max_ahead_steps`` is
      ``None``): with ``η = max_ahead_steps``, ``N_r`` the total samples submitted so far
      *including the new ones* and ``i`` the current policy step, a submission is admitted only if
      ``⌊(N_r − 1) / B⌋ ≤ i + η`` — sample number N_r would be trained at step ⌊(N_r − 1)/B⌋ at the
      earliest, at most η steps after the policy that generates it.

    :meth:`on_submit` without a ``step`` checks the max-ahead rule against the latest policy step
    this controller was told about (via :meth:`on_sync`, :meth:`can_submit` or :meth:`on_submit`).
    """

    def __init__(
        self,
        samples_per_step: int,
        staleness_threshold: float = 0.0,
        trigger_parameter_sync_step: int = 1,
        max_ahead_steps: int | None = None,
    ) -> None:
        _validate_quota_args(samples_per_step, staleness_threshold, trigger_parameter_sync_step)
        if max_ahead_steps is not None:
            _require_int("max_ahead_steps", max_ahead_steps, 0)
        self.samples_per_step = samples_per_step
        self.staleness_threshold = float(staleness_threshold)
        self.trigger_parameter_sync_step = trigger_parameter_sync_step
        self.max_ahead_steps = max_ahead_steps
        self._quota = self.rollout_num(
            samples_per_step, staleness_threshold, trigger_parameter_sync_step
        )
        self._submitted_total = 0
        self._dropped_total = 0
        self._step = 0
        self._syncs = 0

    @staticmethod
    def rollout_num(
        samples_per_step: int,
        staleness_threshold: float,
        trigger_parameter_sync_step: int,
        num_stale_samples: int = 0,
    ) -> int:
        """Seed 002's per-sync sample budget ``ceil((1 + st) · k · B) − num_stale_samples``,
        clamped at 0. E.g. B=8, st=0.5, k=2 → 24; with 5 stale samples → 19."""
        _validate_quota_args(samples_per_step, staleness_threshold, trigger_parameter_sync_step)
        _require_int("num_stale_samples", num_stale_samples, 0)
        budget = (1 + _exact(staleness_threshold)) * trigger_parameter_sync_step * samples_per_step
        return max(0, math.ceil(budget) - num_stale_samples)

    @property
    def quota(self) -> int:
        """Samples the rollouter may still submit before the next sync (seed 002)."""
        return self._quota

    @property
    def submitted_total(self) -> int:
        """``N_r`` before the next submission: samples submitted since the start."""
        return self._submitted_total

    def _note_step(self, step: int) -> None:
        _require_int("step", step, 0)
        self._step = max(self._step, step)

    def _ahead_ok(self, n: int, step: int) -> bool:
        if self.max_ahead_steps is None or n == 0:
            return True
        # the last of the new samples is the binding one; dropped (too stale) samples never
        # became training data, so they do not count against the trainer's progress
        n_r = self._submitted_total - self._dropped_total + n
        return (n_r - 1) // self.samples_per_step <= step + self.max_ahead_steps

    def on_sync(self, step: int, outstanding_samples: int) -> int:
        """A parameter sync to policy ``step`` happened with ``outstanding_samples`` generated or in
        flight but not yet consumed; set and return the new quota (seed 002's rollout_num)."""
        _require_int("step", step, 0)
        if step < self._step:
            raise ValueError(
                f"policy step went backwards ({step} < {self._step}); pass the trainer's current "
                "global step, which never decreases"
            )
        self._note_step(step)
        self._syncs += 1
        self._quota = self.rollout_num(
            self.samples_per_step,
            self.staleness_threshold,
            self.trigger_parameter_sync_step,
            _require_int("outstanding_samples", outstanding_samples, 0),
        )
        return self._quota

    def can_submit(self, n: int, step: int) -> bool:
        """Whether ``n`` more samples may be submitted now, at policy ``step`` (both rules)."""
        _require_int("n", n, 0)
        self._note_step(step)
        return n <= self._quota and self._ahead_ok(n, step)

    def on_submit(self, n: int, step: int | None = None) -> None:
        """Record ``n`` submitted samples: the quota decreases and ``N_r`` increases. Raises
        ``ValueError`` (nothing recorded) if that would violate either rule."""
        _require_int("n", n, 0)
        if step is not None:
            self._note_step(step)
        if n > self._quota:
            raise ValueError(
                f"submitting {n} samples exceeds the staleness quota ({self._quota} left until "
                "the next sync); check can_submit() first and wait for on_sync()"
            )
        if not self._ahead_ok(n, self._step):
            raise ValueError(
                f"submitting {n} samples would put N_r={self._submitted_total + n} more than "
                f"max_ahead_steps={self.max_ahead_steps} steps ahead of policy step {self._step}; "
                "check can_submit() first and wait for the trainer to advance"
            )
        self._quota -= n
        self._submitted_total += n

    def on_dropped(self, n: int) -> None:
        """``n`` submitted samples were discarded unused (``max_off_policy_steps``): give them
        back to the quota and take them out of ``N_r`` for the max-ahead rule, so discarding
        cannot starve the trainer between two syncs."""
        _require_int("n", n, 0)
        self._dropped_total += n
        self._quota += n

    def state_dict(self) -> dict[str, Any]:
        """Quota, ``N_r``, dropped samples, latest policy step and sync count (JSON)."""
        return {
            "quota": self._quota,
            "submitted_total": self._submitted_total,
            "dropped_total": self._dropped_total,
            "step": self._step,
            "syncs": self._syncs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the constructor arguments are not part of the state)."""
        try:
            values = {k: _require_int(k, state[k], 0) for k in self.state_dict()}
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"not a StalenessController state_dict ({exc!r}); pass the dict from "
                "StalenessController.state_dict()"
            ) from exc
        self._quota = values["quota"]
        self._submitted_total = values["submitted_total"]
        self._dropped_total = values["dropped_total"]
        self._step = values["step"]
        self._syncs = values["syncs"]


def _validate_quota_args(samples_per_step: Any, staleness_threshold: Any, sync_step: Any) -> None:
    _require_int("samples_per_step", samples_per_step, 1)
    _require_int("trigger_parameter_sync_step", sync_step, 1)
    if (
        isinstance(staleness_threshold, bool)
        or not isinstance(staleness_threshold, int | float)
        or not math.isfinite(staleness_threshold)
        or staleness_threshold < 0
    ):
        raise ValueError(
            f"staleness_threshold must be a finite number >= 0, got {staleness_threshold!r}; "
            "pass 0 for synchronous training or e.g. 0.5 (seed 002 recommends < 1)"
        )


# ---------------------------------------------------------------------------------------------
# Staleness accounting
# ---------------------------------------------------------------------------------------------


def step_of_version(step_start_versions: Sequence[int], version: int) -> int:
    """The version clock: the trainer step whose weights had weight ``version``, i.e. the last
    step ``s`` with ``step_start_versions[s] <= version`` (0 for anything older than the first
    entry). ``step_start_versions[s]`` is the weight version trainer step ``s`` started from;
    versions only grow (a version counts optimizer steps, several per trainer step), so this is
    a binary search. The runtime's staleness, the learner's per-token staleness and the partial
    rollout spans all read steps through it."""
    return max(0, bisect.bisect_right(step_start_versions, version) - 1)


def steps_behind(token_versions: Sequence[int], current_step: int) -> int:
    """Staleness of a sample whose tokens were produced by the policy steps ``token_versions``
    (several with partial rollouts, seed 002 mode d), trained at ``current_step``:
    ``current_step − min(token_versions)``; 0 for an empty list. A version newer than
    ``current_step`` is an accounting bug and raises ``ValueError``."""
    _require_int("current_step", current_step, 0)
    versions = list(token_versions)
    if not versions:
        return 0
    if max(versions) > current_step:
        raise ValueError(
            f"token version {max(versions)} is newer than current_step {current_step}; pass the "
            "trainer step that consumes the sample"
        )
    return current_step - min(versions)


def _nearest_rank(sorted_values: list[int], pct: int) -> int:
    return sorted_values[max(1, math.ceil(pct * len(sorted_values) / 100)) - 1]


def staleness_metrics(
    staleness: Sequence[int], prefix: str = "async/staleness/"
) -> dict[str, float]:
    """Distribution of per-sample staleness (steps behind) for logging.

    Keys (after ``prefix``): ``count``, ``mean``, ``min``, ``max``, ``p50``, ``p90``, ``p99`` and
    ``hist/0`` … ``hist/<max>`` (how many samples have each staleness value, zeros included up to
    the max). Percentiles are *nearest-rank*: with the n values sorted ascending, ``p_q`` is the
    value at 1-based rank ``ceil(q/100 · n)`` (so always an observed value; p50 of [0, 1] is 0).
    Empty input → ``{prefix + "count": 0.0}`` only. Negative staleness raises ``ValueError``.
    """
    values = sorted(_require_int("staleness value", v) for v in staleness)
    if not values:
        return {prefix + "count": 0.0}
    if values[0] < 0:
        raise ValueError(f"staleness must be >= 0, got {values[0]}; compute it with steps_behind()")
    n = len(values)
    out = {
        prefix + "count": float(n),
        prefix + "mean": sum(values) / n,
        prefix + "min": float(values[0]),
        prefix + "max": float(values[-1]),
        prefix + "p50": float(_nearest_rank(values, 50)),
        prefix + "p90": float(_nearest_rank(values, 90)),
        prefix + "p99": float(_nearest_rank(values, 99)),
    }
    hist = [0] * (values[-1] + 1)
    for v in values:
        hist[v] += 1
    for v, c in enumerate(hist):
        out[f"{prefix}hist/{v}"] = float(c)
    return out
