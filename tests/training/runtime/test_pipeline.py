"""Tests for training/runtime/pipeline.py (dispatch order, drain order, staleness quota).

Expected values are worked out by hand in the comments next to them; the hypothesis properties
state the invariants the seeds ask for (seed 000: windowed FIFO / length-aware dispatch; seed 002:
staleness_threshold quota; seed 004: ⌊(N_r − 1)/B⌋ ≤ i + η).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from training.runtime.pipeline import (
    DISPATCH_MODES,
    DRAIN_MODES,
    Dispatcher,
    GroupBuffer,
    StalenessController,
    staleness_metrics,
    steps_behind,
)


@dataclass
class G:
    """A stand-in completed group: the buffer only reads ``group_id``."""

    group_id: int


def drain_all(d: Dispatcher) -> list[tuple[int, int]]:
    out = []
    while (item := d.pop()) is not None:
        out.append(item)
    return out


def ids(groups: list[G] | None) -> list[int] | None:
    return None if groups is None else [g.group_id for g in groups]


# ---------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------


def test_dispatch_modes_constant_and_bad_arguments():
    assert DISPATCH_MODES == ("fifo", "length_aware")
    with pytest.raises(ValueError, match="use one of"):
        Dispatcher(mode="shortest_first")
    with pytest.raises(ValueError, match=r"ema_alpha must be in \(0, 1\]"):
        Dispatcher(ema_alpha=0.0)
    with pytest.raises(ValueError, match="ema_alpha"):
        Dispatcher(ema_alpha=1.5)
    d = Dispatcher()
    with pytest.raises(ValueError, match="n must be >= 1"):
        d.add_group(0, "p", 0)
    d.add_group(0, "p", 2)
    with pytest.raises(ValueError, match="new group_id"):
        d.add_group(0, "p", 2)


def test_probes_go_before_already_queued_non_probes():
    d = Dispatcher("length_aware")
    d.load_state_dict({"expected_len": {"known": 100.0}, "probes": 0, "cache_hits": 0})
    d.add_group(0, "known", 2)  # cache hit: both samples queued at priority 100
    d.add_group(1, "new_a", 3)  # probe (1, 0); samples 1, 2 held
    d.add_group(2, "new_b", 3)  # probe (2, 0); samples 1, 2 held
    assert (d.pending(), d.held()) == (4, 4)
    # probes first, among themselves in submission order; then the earlier-queued cache hit
    assert drain_all(d) == [(1, 0), (2, 0), (0, 0), (0, 1)]
    assert d.stats() == {
        "dispatch/probes": 2.0,
        "dispatch/cache_hits": 1.0,
        "dispatch/cache_size": 1.0,
    }


def test_held_samples_released_after_probe_longer_first():
    d = Dispatcher("length_aware")
    d.add_group(0, "short", 3)
    d.add_group(1, "long", 3)
    assert drain_all(d) == [(0, 0), (1, 0)]  # only the probes are ready
    assert (d.pending(), d.held()) == (0, 4)
    d.complete(0, 0, 10)  # releases (0, 1), (0, 2) at priority 10
    assert (d.pending(), d.held()) == (2, 2)
    d.complete(1, 0, 50)  # releases (1, 1), (1, 2) at priority 50 → ahead of group 0's
    assert (d.pending(), d.held()) == (4, 0)
    assert drain_all(d) == [(1, 1), (1, 2), (0, 1), (0, 2)]
    assert d.expected_length("short") == 10.0
    assert d.expected_length("long") == 50.0


def test_equal_lengths_tie_by_submission_order():
    d = Dispatcher("length_aware")
    d.load_state_dict({"expected_len": {"a": 7.0, "b": 7.0}, "probes": 0, "cache_hits": 0})
    d.add_group(5, "b", 2)
    d.add_group(3, "a", 2)  # same length, submitted later → after group 5
    assert drain_all(d) == [(5, 0), (5, 1), (3, 0), (3, 1)]


def test_cache_hit_in_second_epoch_dispatches_all_without_probe():
    d = Dispatcher("length_aware", ema_alpha=1.0)
    d.add_group(0, "q", 4)
    assert drain_all(d) == [(0, 0)]
    d.complete(0, 0, 30)
    assert drain_all(d) == [(0, 1), (0, 2), (0, 3)]
    for i in (1, 2, 3):
        d.complete(0, i, 30)
    # epoch 2: same prompt → no probe, all 4 ready at once
    d.add_group(1, "q", 4)
    assert (d.pending(), d.held()) == (4, 0)
    assert drain_all(d) == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert d.stats()["dispatch/probes"] == 1.0
    assert d.stats()["dispatch/cache_hits"] == 1.0


def test_ema_arithmetic_exact():
    # α = 0.5: first observation sets it (10); then 0.5·20 + 0.5·10 = 15; then 0.5·30 + 0.5·15
    # = 22.5
    d = Dispatcher("length_aware", ema_alpha=0.5)
    d.add_group(0, "p", 3)
    d.pop()
    d.complete(0, 0, 10)
    assert d.expected_length("p") == 10.0
    d.pop()
    d.complete(0, 1, 20)  # non-probe samples refresh the estimate too
    assert d.expected_length("p") == 15.0
    d.pop()
    d.complete(0, 2, 30)
    assert d.expected_length("p") == 22.5
    # α = 0.25: 10 then 0.25·20 + 0.75·10 = 12.5
    d = Dispatcher("fifo", ema_alpha=0.25)
    d.add_group(0, "p", 2)
    d.pop(), d.pop()
    d.complete(0, 0, 10)
    d.complete(0, 1, 20)
    assert d.expected_length("p") == 12.5
    assert d.expected_length("never") is None


def test_fifo_preserves_submission_order_and_never_holds():
    d = Dispatcher("fifo")
    d.load_state_dict({"expected_len": {"long": 1e6}, "probes": 0, "cache_hits": 0})
    d.add_group(0, "short", 2)
    d.add_group(1, "long", 2)  # a long cached length does not jump the queue in fifo mode
    d.add_group(2, "new", 3)  # no probe either
    assert d.held() == 0
    assert drain_all(d) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert d.stats()["dispatch/probes"] == 0.0


def test_requeue_goes_to_the_front_and_probe_survives_requeue():
    d = Dispatcher("length_aware")
    d.add_group(0, "a", 2)
    d.add_group(1, "b", 2)
    assert d.pop() == (0, 0)
    d.requeue(0, 0)  # failed probe: back at the very front, still the probe
    assert d.pop() == (0, 0)
    assert d.pop() == (1, 0)
    d.complete(0, 0, 5)  # probe completes → releases (0, 1)
    assert d.pop() == (0, 1)
    d.requeue(0, 1)
    d.add_group(2, "c", 2)  # a new probe still goes after the retried sample
    assert drain_all(d) == [(0, 1), (2, 0)]
    with pytest.raises(ValueError, match="not in flight"):
        d.requeue(2, 1)  # held, never popped


def test_complete_unknown_group_and_forgetting_finished_groups():
    d = Dispatcher("length_aware")
    with pytest.raises(ValueError, match="unknown"):
        d.complete(9, 0, 3)
    d.add_group(0, "p", 2)
    d.pop()
    with pytest.raises(ValueError, match="not in flight"):
        d.complete(0, 1, 3)  # still held
    d.complete(0, 0, 3)
    d.pop()
    d.complete(0, 1, 3)
    # all samples completed → bookkeeping forgotten: the id is unknown again and can be reused
    with pytest.raises(ValueError, match="unknown"):
        d.complete(0, 1, 3)
    assert d._groups == {}
    d.add_group(0, "p", 1)


def test_dispatcher_state_dict_round_trip_is_json():
    d = Dispatcher("length_aware")
    d.add_group(0, "p", 1)
    d.pop()
    d.complete(0, 0, 42)
    d.add_group(1, "p", 1)
    state = json.loads(json.dumps(d.state_dict()))
    e = Dispatcher("length_aware")
    e.load_state_dict(state)
    assert e.state_dict() == d.state_dict()
    assert e.expected_length("p") == 42.0
    assert e.stats() == d.stats()
    assert e.pending() == 0  # the queue is not persisted
    with pytest.raises(ValueError, match=r"Dispatcher\.state_dict"):
        e.load_state_dict({"probes": 1})


@settings(max_examples=60)
@given(
    mode=st.sampled_from(DISPATCH_MODES),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    keys=st.lists(st.sampled_from("abc"), min_size=8, max_size=8),
    choices=st.lists(st.integers(0, 100), min_size=80, max_size=80),
)
def test_every_sample_dispatched_exactly_once(mode, sizes, keys, choices):
    # Conservation: whatever order the engines finish (or fail and retry) in, each of the
    # Σ n samples is completed exactly once, and the dispatcher ends empty (nothing stuck held).
    d = Dispatcher(mode)
    for gid, n in enumerate(sizes):
        d.add_group(gid, keys[gid], n)
    in_flight: list[tuple[int, int]] = []
    done: list[tuple[int, int]] = []
    step = 0
    while d.pending() or in_flight:
        c = choices[step % len(choices)]
        step += 1
        if d.pending() and (c % 3 == 0 or not in_flight):
            in_flight.append(d.pop())
            continue
        item = in_flight.pop(c % len(in_flight))
        if c % 7 == 0 and step < 200:
            d.requeue(*item)
        else:
            d.complete(*item, response_len=c)
            done.append(item)
    assert sorted(done) == [(g, i) for g, n in enumerate(sizes) for i in range(n)]
    assert (d.pending(), d.held(), d._groups) == (0, 0, {})


# ---------------------------------------------------------------------------------------------
# GroupBuffer
# ---------------------------------------------------------------------------------------------


def make_buffer(drain: str, window: int = 16, submitted: int = 0) -> GroupBuffer:
    b = GroupBuffer(drain, window)
    for gid in range(submitted):
        b.submitted(gid)
    return b


def test_drain_bad_arguments():
    assert DRAIN_MODES == ("submission", "fifo", "windowed_fifo")
    with pytest.raises(ValueError, match="use one of"):
        GroupBuffer("lifo")
    with pytest.raises(ValueError, match="pass window >= 1"):
        GroupBuffer("windowed_fifo", window=0)
    b = make_buffer("fifo", submitted=3)
    with pytest.raises(ValueError, match="strictly increasing"):
        b.submitted(2)
    with pytest.raises(ValueError, match="call submitted"):
        b.put(G(7))
    b.put(G(1))
    with pytest.raises(ValueError, match="already buffered"):
        b.put(G(1))
    with pytest.raises(ValueError, match="k must be >= 1"):
        b.take(0)


def test_submission_drain_blocks_on_head():
    b = make_buffer("submission", submitted=4)
    for gid in (3, 1, 2):
        b.put(G(gid))
    assert b.take(1) is None  # group 0 (the head) is still generating
    assert len(b) == 3  # all-or-nothing: nothing removed
    b.put(G(0))
    assert ids(b.take(3)) == [0, 1, 2]
    assert b.head == 3
    assert b.take(2) is None  # only group 3 left
    assert ids(b.take(1)) == [3]
    assert b.head == 4  # none outstanding → next id to be submitted


def test_naive_fifo_takes_arrival_order():
    b = make_buffer("fifo", submitted=5)
    for gid in (4, 2, 0, 3):
        b.put(G(gid))
    assert ids(b.take(3)) == [4, 2, 0]  # easy/short prompts that finished first win
    assert b.take(2) is None
    assert ids(b.take(1)) == [3]
    assert b.head == 1  # group 1 still in flight
    assert b.outstanding() == 1


def test_windowed_fifo_never_takes_outside_the_window_even_if_first_to_arrive():
    b = make_buffer("windowed_fifo", window=2, submitted=5)
    for gid in (4, 3, 0):
        b.put(G(gid))
    # head 0, window [0, 2): 4 and 3 arrived first but are not eligible
    assert ids(b.take(1)) == [0]
    assert b.head == 1
    assert b.take(1) is None  # window [1, 3): neither 4 nor 3
    b.put(G(1))
    # take 1 (head 1, window [1, 3)); head → 2, window [2, 4) → 3 eligible, next in arrival order
    assert ids(b.take(2)) == [1, 3]
    assert b.take_log == ((0, 0), (1, 1), (3, 2))
    assert b.head == 2
    assert b.buffered_ids() == [4]


def test_windowed_fifo_window_slides_within_one_take():
    # window 1 can still take 3 groups in one call: each removal advances head by one
    b = make_buffer("windowed_fifo", window=1, submitted=3)
    for gid in (2, 1, 0):
        b.put(G(gid))
    assert ids(b.take(3)) == [0, 1, 2]
    assert b.take_log == ((0, 0), (1, 1), (2, 2))


def test_drop_frees_the_window():
    b = make_buffer("windowed_fifo", window=2, submitted=5)
    for gid in (3, 0, 2):
        b.put(G(gid))
    assert ids(b.drop(lambda g: g.group_id in (0, 3))) == [3, 0]  # e.g. too stale; arrival order
    assert b.head == 1  # dropped 0 counts as consumed
    assert ids(b.take(1)) == [2]  # window [1, 3) now admits 2 while 1 is still generating
    assert b.head == 1
    assert b.outstanding() == 2  # 1 in flight, 4 in flight


def test_drop_and_abandon_advance_head():
    b = make_buffer("windowed_fifo", window=1, submitted=4)
    for gid in (0, 2, 3):
        b.put(G(gid))
    assert ids(b.drop(lambda g: g.group_id == 0)) == [0]
    assert b.head == 1
    assert b.take(1) is None  # window [1, 2): group 1 is still generating
    b.abandon(1)  # generation failed permanently: counts as consumed
    assert b.head == 2
    assert ids(b.take(2)) == [2, 3]
    assert b.head == 4
    assert b.outstanding() == 0
    with pytest.raises(ValueError, match="not outstanding"):
        b.abandon(1)
    b.submitted(4)
    b.put(G(4))
    with pytest.raises(ValueError, match="use drop"):
        b.abandon(4)
    assert b.state_dict()["dropped"] == 1
    assert b.state_dict()["abandoned"] == 1
    assert b.state_dict()["consumed"] == 2


def test_take_log_is_bounded():
    b = make_buffer("fifo")
    for gid in range(10_005):
        b.submitted(gid)
        b.put(G(gid))
        b.take(1)
    log = b.take_log
    assert len(log) == 10_000
    assert log[0] == (5, 5)
    assert log[-1] == (10_004, 10_004)


def test_group_buffer_state_dict_round_trip():
    b = make_buffer("windowed_fifo", window=4, submitted=6)
    for gid in (1, 0, 4):
        b.put(G(gid))
    b.take(1)  # takes 1 (arrived first, inside window [0, 4)) → head stays 0
    b.abandon(2)
    state = json.loads(json.dumps(b.state_dict()))
    assert state["head"] == 0
    assert state["outstanding_ids"] == [0, 3, 4, 5]
    c = GroupBuffer("windowed_fifo", window=4)
    c.load_state_dict(state)
    assert c.state_dict() == b.state_dict()
    assert len(c) == 0  # groups are not persisted: the caller re-puts them
    for g in (G(0), G(4)):
        c.put(g)
    assert ids(c.take(2)) == [0, 4]  # 0 then head → 3, window [3, 7) admits 4
    with pytest.raises(ValueError, match="strictly increasing"):
        c.submitted(5)
    c.submitted(6)
    with pytest.raises(ValueError, match="inconsistent"):
        GroupBuffer().load_state_dict({**state, "head": 3})


take_ops = st.lists(st.integers(1, 4), min_size=1, max_size=30)


@settings(max_examples=150)
@given(
    perm=st.permutations(range(12)),
    window=st.integers(1, 6),
    takes=take_ops,
    arrivals_per_take=st.integers(1, 4),
)
def test_windowed_fifo_invariant_over_random_arrival_orders(perm, window, takes, arrivals_per_take):
    # Seed 000's windowed drain: whatever order groups complete in and whatever batch sizes the
    # trainer asks for, every taken group satisfies group_id < head + window, where head is the
    # oldest unconsumed group at the moment that group was taken; head always equals the oldest
    # outstanding id; and a take returns exactly k groups or nothing (all-or-nothing).
    b = make_buffer("windowed_fifo", window=window, submitted=12)
    arrivals = iter(perm)
    consumed: list[int] = []
    for k in takes:
        for _ in range(arrivals_per_take):
            gid = next(arrivals, None)
            if gid is not None:
                b.put(G(gid))
        before = len(b)
        got = ids(b.take(k))
        if got is None:
            assert len(b) == before
        else:
            assert len(got) == k
            consumed += got
        remaining = set(range(12)) - set(consumed)
        assert b.head == (min(remaining) if remaining else 12)
    assert [g for g, _ in b.take_log] == consumed
    for gid, head_before in b.take_log:
        assert head_before <= gid < head_before + window
    assert len(set(consumed)) == len(consumed)


@settings(max_examples=100)
@given(perm=st.permutations(range(10)), takes=take_ops)
def test_window_one_equals_submission_order(perm, takes):
    # window = 1 admits only the head, so windowed FIFO degenerates to the strict submission drain.
    w = make_buffer("windowed_fifo", window=1, submitted=10)
    s = make_buffer("submission", submitted=10)
    arrivals = iter(perm)
    for k in takes:
        gid = next(arrivals, None)
        if gid is not None:
            w.put(G(gid))
            s.put(G(gid))
        assert ids(w.take(k)) == ids(s.take(k))
        assert w.head == s.head


@settings(max_examples=100)
@given(perm=st.permutations(range(10)), takes=take_ops)
def test_huge_window_equals_naive_fifo(perm, takes):
    # a window wider than everything outstanding never binds: windowed FIFO = naive FIFO.
    w = make_buffer("windowed_fifo", window=10, submitted=10)
    f = make_buffer("fifo", submitted=10)
    arrivals = iter(perm)
    for k in takes:
        gid = next(arrivals, None)
        if gid is not None:
            w.put(G(gid))
            f.put(G(gid))
        assert ids(w.take(k)) == ids(f.take(k))


# ---------------------------------------------------------------------------------------------
# StalenessController
# ---------------------------------------------------------------------------------------------


def test_rollout_num_examples():
    rn = StalenessController.rollout_num
    assert rn(8, 0.5, 2) == 24  # (1 + 0.5) · 2 · 8 = 24
    assert rn(8, 0.5, 2, num_stale_samples=5) == 19  # 24 − 5
    assert rn(8, 0.0, 1) == 8  # synchronous: exactly B
    assert rn(8, 0.0, 3) == 24  # stream off-policy (seed 002 mode b): k · B
    assert rn(10, 0.1, 1) == 11  # (1.1 · 10 = 11 exactly, not float 11.000000000000002 → 12)
    assert rn(4, 0.3, 1) == 6  # 1.3 · 4 = 5.2 → ceil 6
    assert rn(8, 1.0, 1) == 16  # st = 1 ≈ one-step off-policy
    assert rn(8, 0.5, 2, num_stale_samples=30) == 0  # never below 0


def test_staleness_controller_bad_arguments():
    with pytest.raises(ValueError, match="samples_per_step must be >= 1"):
        StalenessController(0)
    with pytest.raises(ValueError, match="staleness_threshold must be a finite number >= 0"):
        StalenessController(8, staleness_threshold=-0.1)
    with pytest.raises(ValueError, match="staleness_threshold"):
        StalenessController(8, staleness_threshold=math.inf)
    with pytest.raises(ValueError, match="trigger_parameter_sync_step must be >= 1"):
        StalenessController(8, trigger_parameter_sync_step=0)
    with pytest.raises(ValueError, match="max_ahead_steps must be >= 0"):
        StalenessController(8, max_ahead_steps=-1)
    with pytest.raises(ValueError, match="num_stale_samples must be >= 0"):
        StalenessController.rollout_num(8, 0.0, 1, -1)
    c = StalenessController(8)
    with pytest.raises(ValueError, match="outstanding_samples must be >= 0"):
        c.on_sync(1, -3)
    c.on_sync(2, 0)
    with pytest.raises(ValueError, match="never decreases"):
        c.on_sync(1, 0)


def test_synchronous_controller_lets_exactly_b_samples_per_sync():
    # st = 0, k = 1 (seed 002 "on policy pipeline"): B per sync, nothing more
    b = 8
    c = StalenessController(b)
    for step in range(4):
        assert c.quota == b
        assert c.can_submit(b, step)
        assert not c.can_submit(b + 1, step)
        for _ in range(b // 4):
            c.on_submit(4, step)
        assert c.quota == 0
        assert not c.can_submit(1, step)
        with pytest.raises(ValueError, match="staleness quota"):
            c.on_submit(1)
        assert c.on_sync(step + 1, outstanding_samples=0) == b  # trainer consumed all B
    assert c.submitted_total == 4 * b


def test_quota_subtracts_stale_samples_at_sync():
    c = StalenessController(8, staleness_threshold=0.5, trigger_parameter_sync_step=2)
    assert c.quota == 24  # initial: formula with 0 stale
    c.on_submit(24)
    # trainer consumed 2 steps · 8 = 16; 8 still buffered/in flight at the sync
    assert c.on_sync(1, outstanding_samples=8) == 16
    assert c.quota == 16


def test_max_ahead_boundary():
    # B = 4, η = 1, policy step 0: ⌊(N_r − 1)/4⌋ ≤ 1 ⟺ N_r ≤ 8
    c = StalenessController(4, staleness_threshold=10.0, max_ahead_steps=1)
    assert c.can_submit(8, step=0)
    assert not c.can_submit(9, step=0)
    for _ in range(8):
        assert c.can_submit(1, step=0)
        c.on_submit(1)
    assert c.submitted_total == 8
    assert not c.can_submit(1, step=0)  # N_r = 9: ⌊8/4⌋ = 2 > 0 + 1
    with pytest.raises(ValueError, match="max_ahead_steps=1"):
        c.on_submit(1)
    assert c.submitted_total == 8  # a refused submission records nothing
    assert c.can_submit(4, step=1)  # trainer advanced: N_r up to 12 allowed
    assert not c.can_submit(5, step=1)
    c.on_submit(4)  # checked against step 1, the latest step seen by can_submit
    assert c.submitted_total == 12
    # η = 0: the rollouter may only generate the current step's batch
    z = StalenessController(4, staleness_threshold=10.0, max_ahead_steps=0)
    assert z.can_submit(4, step=0)
    assert not z.can_submit(5, step=0)


@settings(max_examples=100)
@given(
    b=st.integers(1, 8),
    threshold=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0]),
    k=st.integers(1, 3),
    eta=st.one_of(st.none(), st.integers(0, 3)),
    actions=st.lists(st.tuples(st.booleans(), st.integers(1, 6)), min_size=1, max_size=60),
)
def test_controller_bounds_hold_in_a_simulated_pipeline(b, threshold, k, eta, actions):
    # A toy rollouter/trainer loop. The rollouter greedily submits when allowed; the trainer
    # takes B samples per step and syncs every k steps. Invariants:
    #  * seed 002: samples outstanding (submitted, not consumed) never exceed
    #    ceil((1 + st) · k · B) — the quota set at a sync is that bound minus what is outstanding;
    #  * seed 004: the j-th sample ever submitted at policy step i has ⌊(j − 1)/B⌋ ≤ i + η.
    c = StalenessController(b, threshold, k, eta)
    bound = StalenessController.rollout_num(b, threshold, k)
    outstanding = 0
    step = 0
    for trainer_acts, n in actions:
        if trainer_acts and outstanding >= b:
            outstanding -= b
            step += 1
            if step % k == 0:
                c.on_sync(step, outstanding)
        elif c.can_submit(n, step):
            first = c.submitted_total + 1
            c.on_submit(n, step)
            outstanding += n
            if eta is not None:
                assert (first + n - 2) // b <= step + eta
        else:
            with pytest.raises(ValueError):
                c.on_submit(n, step)
        assert 0 <= outstanding <= bound
        assert c.quota >= 0


def test_staleness_controller_state_dict_round_trip():
    c = StalenessController(4, 0.5, 2, max_ahead_steps=2)
    c.on_submit(5, step=0)
    c.on_sync(2, outstanding_samples=3)  # quota = 12 − 3 = 9
    state = json.loads(json.dumps(c.state_dict()))
    assert state == {"quota": 9, "submitted_total": 5, "dropped_total": 0, "step": 2,
                     "syncs": 1}
    d = StalenessController(4, 0.5, 2, max_ahead_steps=2)
    d.load_state_dict(state)
    assert (d.quota, d.submitted_total) == (9, 5)
    assert d.state_dict() == c.state_dict()
    with pytest.raises(ValueError, match=r"StalenessController\.state_dict"):
        d.load_state_dict({"quota": 1})


# ---------------------------------------------------------------------------------------------
# staleness accounting
# ---------------------------------------------------------------------------------------------


def test_steps_behind():
    assert steps_behind([3, 4, 5], 7) == 4  # oldest token from step 3 → 7 − 3
    assert steps_behind([7], 7) == 0
    assert steps_behind([], 7) == 0
    with pytest.raises(ValueError, match="newer than current_step"):
        steps_behind([8], 7)


def test_staleness_metrics_hand_computed():
    m = staleness_metrics([3, 0, 1, 0])
    # sorted [0, 0, 1, 3]; mean 4/4 = 1; p50 rank ceil(0.5·4) = 2 → 0; p90 rank ceil(3.6) = 4 → 3
    assert m == {
        "async/staleness/count": 4.0,
        "async/staleness/mean": 1.0,
        "async/staleness/min": 0.0,
        "async/staleness/max": 3.0,
        "async/staleness/p50": 0.0,
        "async/staleness/p90": 3.0,
        "async/staleness/p99": 3.0,  # rank ceil(3.96) = 4 → 3
        "async/staleness/hist/0": 2.0,
        "async/staleness/hist/1": 1.0,
        "async/staleness/hist/2": 0.0,
        "async/staleness/hist/3": 1.0,
    }
    # ten values 1..10: p50 rank 5 → 5, p90 rank 9 → 9, p99 rank ceil(9.9) = 10 → 10
    m = staleness_metrics(list(range(1, 11)), prefix="s/")
    assert (m["s/p50"], m["s/p90"], m["s/p99"], m["s/mean"], m["s/hist/0"]) == (
        5.0, 9.0, 10.0, 5.5, 0.0)
    assert staleness_metrics([]) == {"async/staleness/count": 0.0}
    assert staleness_metrics([], prefix="x/") == {"x/count": 0.0}
    with pytest.raises(ValueError, match="steps_behind"):
        staleness_metrics([1, -1])


def test_dropped_samples_are_credited_back():
    # B = 4, η = 0, st = 0, k = 1: quota 4 and N_r ≤ 4 at step 0
    c = StalenessController(4, max_ahead_steps=0)
    c.on_submit(4, step=0)
    assert not c.can_submit(1, 0)  # quota 0 and ⌊(5 − 1)/4⌋ = 1 > 0
    c.on_dropped(2)  # two of them were too stale and discarded unused
    assert c.quota == 2
    assert c.can_submit(2, 0)  # effective N_r = 4 − 2 + 2 = 4 → ⌊3/4⌋ = 0 ≤ 0
    assert not c.can_submit(3, 0)
    assert c.state_dict()["dropped_total"] == 2


def test_the_version_clock_maps_weight_versions_to_trainer_steps():
    from training.runtime.pipeline import step_of_version

    # 4 optimizer steps per trainer step: step s started from version 4·s (versions 0..11)
    starts = [0, 4, 8]
    assert [step_of_version(starts, v) for v in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert step_of_version(starts, 100) == 2  # newer than the last start: the current step
    assert step_of_version([3, 5], 1) == 0  # older than the first start (a resumed run)
    assert step_of_version([], 7) == 0
