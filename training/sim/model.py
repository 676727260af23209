"""A discrete-event model of the async RL pipeline: rollouter, engines, sample buffer, trainer and
parameter sync (pure Python, stdlib only; deterministic given ``seed``).

Generation (seed 002's long tail). Response ``j`` has length ``L_j`` drawn from a capped
log-normal. The engines are one processor-sharing pool: with ``k`` sequences running, every one
of them gains tokens at

    r(k) = speed_gen / (t0 · (1 + k / knee))            knee = devices · load_knee

(a decode iteration costs ``t0`` for one sequence and grows linearly with the batch; perfect load
balance across devices). Because every running sequence advances at the same rate, a sequence
finishes when the pool's *virtual clock* ``V`` (tokens any always-running sequence would have
produced) reaches ``V_admit + L_j``: one heap keyed by finish-V, O(log k) per event. For a batch
submitted at once this gives the closed form ``T = t0 · (L_max + ΣL / knee)`` — the longest
response sets the time and the rest is a throughput term — so ``t0`` is fitted exactly from a
measured generation time (it scales every generation time linearly).

Rollouter (seed 002's quota, seed 004's rate limit). The rollouter submits response ``N_r`` while
``N_r < consumed_at_last_sync + (1 + θ) · K · B`` (θ staleness threshold: sync 0, one_step 1;
K trigger_parameter_sync_step; B responses per trainer step) and, with max-ahead η,
``N_r < (i + η + 1) · B`` (i trainer steps done). At most ``cap`` sequences run; the rest queue.

Trainer. Lockstep modes (sync, one_step) train batch ``i`` = responses ``[iB, (i+1)B)`` once all
are complete (submission order); fully_async trains any ``B`` completed responses (arrival
order). A step is ``B · c`` seconds of work (``c`` per-response train cost) at ``speed_train``.
After every ``K``-th step the weights sync for ``sync_s``: with partial rollout the running
sequences pause and resume after it; without, no new response is submitted and the sync waits
for the running ones to finish (trainer idle meanwhile).

CPU contention (cores as a shared resource). With ``cores`` set, the demanded cores are
``engine_cores + overhead_cores`` while any sequence runs plus ``train_cores`` while training;
each phase gets ``min(1, cores / demand)`` of what it asks, and a phase given ``a`` cores runs at
``a`` (a ≤ 1) or ``1 + (a − 1) · extra_core_efficiency`` (a > 1) times its one-core speed.

Departures from the real runtime: lengths are i.i.d. (no prompt groups, no response-length drift
as training goes on — seed 002's require_batches ablation is such a drift and enters only through
each row's own published train time), load balance is perfect, evaluation is not modelled.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

__all__ = ["Pipeline", "SimResult", "draw_lengths", "simulate"]


@dataclass(frozen=True)
class Pipeline:
    """Resolved numbers of one simulated run (times in seconds, lengths in tokens)."""

    steps: int  # trainer steps
    samples_per_step: int  # B (simulated responses per trainer step)
    sync_interval: int  # K
    quota_threshold: float  # θ
    partial_rollout: bool
    lockstep: bool  # sync / one_step: train batch i in submission order
    max_ahead_steps: int | None
    t0: float  # seconds per token of a lone sequence at speed 1
    knee: float  # devices · load_knee (simulated scale)
    max_running: int | None
    train_cost_per_sample: float  # seconds at speed 1
    sync_s: float
    mean_tokens: float
    sigma: float
    max_tokens: float
    seed: int = 0
    cores: float | None = None
    engine_cores: float = 1.0
    train_cores: float = 1.0
    overhead_cores: float = 0.0
    extra_core_efficiency: float = 1.0
    shared_speed: float = 1.0  # speed each phase keeps beside the other, cores aside


@dataclass(frozen=True)
class SimResult:
    """What one simulated run measured."""

    wall_s: float
    trained_samples: int
    gen_wait_s: float  # trainer idle waiting for data
    train_s: float  # trainer busy
    sync_s: float  # in or waiting for syncs
    rollout_idle_ratio: float  # time no sequence was running / wall
    overlap_s: float  # time generation and training both ran
    contention_factor: float  # min(1, cores / demand) while both ran (1 without contention)
    mean_staleness: float  # syncs between a response's submission and its training

    @property
    def time_per_sample(self) -> float:
        return self.wall_s / self.trained_samples


def draw_lengths(count: int, mean_tokens: float, sigma: float, max_tokens: float,
                 seed: int) -> list[float]:
    """``count`` capped log-normal lengths with uncapped mean ``mean_tokens`` (deterministic)."""
    rng = random.Random(seed)
    mu = math.log(mean_tokens) - sigma * sigma / 2
    return [min(max_tokens, max(1.0, rng.lognormvariate(mu, sigma))) for _ in range(count)]


def _speed(alloc: float, extra: float) -> float:
    return alloc if alloc <= 1.0 else 1.0 + (alloc - 1.0) * extra


def simulate(p: Pipeline) -> SimResult:
    """Run the event loop of the module docstring to the end of ``p.steps`` trainer steps."""
    B, K = p.samples_per_step, p.sync_interval
    total = p.steps * B
    lengths = draw_lengths(total, p.mean_tokens, p.sigma, p.max_tokens, p.seed)
    quota = math.ceil((1.0 + p.quota_threshold) * K * B - 1e-9)

    t = V = 0.0
    running: list[tuple[float, int]] = []  # (finish V, response id)
    queued: deque[int] = deque()
    arrived: deque[int] = deque()  # completed, not yet trained (fully_async)
    done_in_batch = [0] * p.steps  # lockstep: completed responses of batch i
    submit_version = [0] * total
    submitted = consumed = consumed_at_sync = steps_done = version = 0
    state, work_left = "wait", 0.0  # wait | train | drain (sync waits for in-flight) | sync
    gen_wait = train_s = sync_s = idle_rollout = overlap = 0.0
    contention_seen = 1.0
    staleness_sum = 0

    def limit() -> int:
        cap = min(total, consumed_at_sync + quota)
        if p.max_ahead_steps is not None:
            cap = min(cap, (steps_done + p.max_ahead_steps + 1) * B)
        return cap

    while True:
        if state in ("wait", "train"):  # a drain or a sync admits nothing new
            top = limit()
            while submitted < top:
                submit_version[submitted] = version
                queued.append(submitted)
                submitted += 1
        if state != "sync":
            while queued and (p.max_running is None or len(running) < p.max_running):
                j = queued.popleft()
                heapq.heappush(running, (V + lengths[j], j))
        if state == "drain" and not running and not queued:
            state, work_left = "sync", p.sync_s
        if state == "wait":
            ready = done_in_batch[steps_done] == B if p.lockstep else len(arrived) >= B
            if ready:
                if p.lockstep:
                    first = steps_done * B
                    batch = range(first, first + B)
                else:
                    batch = [arrived.popleft() for _ in range(B)]
                staleness_sum += sum(version - submit_version[j] for j in batch)
                consumed += B
                state, work_left = "train", B * p.train_cost_per_sample

        gen_on = bool(running) and state != "sync"
        train_on = state == "train"
        factor = 1.0
        sg = st = 1.0
        if p.cores is not None:
            demand = ((p.engine_cores + p.overhead_cores) if gen_on else 0.0) + (
                p.train_cores if train_on else 0.0)
            factor = min(1.0, p.cores / demand) if demand > 0 else 1.0
            if gen_on and train_on:
                factor *= p.shared_speed
            sg = _speed(p.engine_cores * factor, p.extra_core_efficiency)
            st = _speed(p.train_cores * factor, p.extra_core_efficiency)
        rate = sg / (p.t0 * (1.0 + len(running) / p.knee)) if gen_on else 0.0
        dt_gen = (running[0][0] - V) / rate if gen_on else math.inf
        dt_phase = math.inf
        if state == "train":
            dt_phase = work_left / st if st > 0 else math.inf
        elif state == "sync":
            dt_phase = work_left
        dt = min(dt_gen, dt_phase)
        assert dt < math.inf, (f"the simulated pipeline stalled at t={t:.3f}s in state {state} "
                               f"(submitted {submitted}, consumed {consumed}); a bug")
        dt = max(dt, 0.0)

        t += dt
        if gen_on:
            V += rate * dt
        else:
            idle_rollout += dt
        if gen_on and train_on:
            overlap += dt
            contention_seen = min(contention_seen, factor)
        if state == "wait":
            gen_wait += dt
        elif state == "train":
            train_s += dt
            work_left -= st * dt
        else:
            sync_s += dt
            if state == "sync":
                work_left -= dt

        if gen_on:
            eps = 1e-9 * max(1.0, abs(V))
            while running and running[0][0] <= V + eps:
                _, j = heapq.heappop(running)
                if p.lockstep:
                    done_in_batch[j // B] += 1
                else:
                    arrived.append(j)
        if state == "train" and dt_phase <= dt_gen and work_left <= 1e-12 * max(1.0, t):
            steps_done += 1
            if steps_done % K == 0 or steps_done == p.steps:
                state = "sync" if p.partial_rollout else "drain"
                work_left = p.sync_s
            else:
                state = "wait"
        elif state == "sync" and dt_phase <= dt_gen and work_left <= 1e-12 * max(1.0, t):
            version += 1
            consumed_at_sync = consumed
            state = "wait"
        if steps_done == p.steps and state == "wait":
            break

    return SimResult(
        wall_s=t, trained_samples=consumed, gen_wait_s=gen_wait, train_s=train_s,
        sync_s=sync_s, rollout_idle_ratio=idle_rollout / t if t else 0.0, overlap_s=overlap,
        contention_factor=contention_seen, mean_staleness=staleness_sum / max(consumed, 1))
