"""The Rollouter (seed 002): turns prompts into scored groups as fast as the staleness limits allow.

It runs as an asyncio Ray actor (:class:`Rollouter`; plain async methods, so it also runs without
Ray) and owns:

- the **prompt stream**: group ``g`` (submission order) is a deterministic function of the recipe
  seed and ``g`` (:func:`example_for_group`), so a group that was in flight when a run stopped is
  regenerated identically on resume;
- the **staleness controller** (seed 002's rollout_num quota per sync, seed 004's max-ahead limit):
  a new group is submitted only when it allows n more samples;
- the **dispatcher** (seed 000 stage 3): fifo or length-aware (probe first, then longest expected
  first, EMA length cache per prompt);
- one :class:`~training.engines.client.RolloutClient` over every rollout engine (load balancing by
  estimated tokens — length-aware dispatch gives each request a ``max_new_tokens`` estimate — health
  checks, retry on another engine when one dies);
- **weight syncs** (:meth:`Rollouter.sync_weights`): with partial rollout the engines are paused
  mid-generation, the weights are loaded and generation continues; without it, submission stops
  and the in-flight requests finish before the weights change. Partial rollouts are interrupted
  one of two ways (``Recipe.partial_interrupt``): ``retract`` — the engine keeps each running
  sequence and re-prefills it under the new weights, reporting the version of every token (the
  embedded engine); ``abort_resume`` — the engines abort in-flight requests, which come back with
  their tokens so far; once the new weights are in, prompt + those tokens are sent again for the
  rest and the pieces are joined (log-probs, per-piece versions, routed experts). ``auto`` takes
  ``abort_resume`` on SGLang: its retract re-prefill drops the routes recorded before it, so a
  retracted sample's routes would follow other rules than the embedded engine's. A load that
  someone else does (each engine directly behind sglang-router; an NCCL broadcast from the
  trainer) is framed by :meth:`Rollouter.begin_weight_sync` / :meth:`Rollouter.end_weight_sync`,
  the two halves of the same sync.
- under ``old_logprob: interrupt`` (seed 003 §5.1), **π_old of every token** while its version is
  still served: an fp32 copy of the served weights (:class:`~training.runtime.interrupt_old.
  HeldPolicy`, loaded from the same directory as the engines at each sync); at a partial-rollout
  sync the engines abort (abort_resume), the rollouter waits for the aborted requests' tokens,
  computes their π_old, and only then loads the new weights; a finished sample gets π_old of its
  remaining tokens (``Sample.old_log_probs``). Reported: ``async/old_logit_interrupt_s`` (the
  stall this adds to a sync: waiting for the aborted tokens, the forward, loading the copy),
  ``async/old_logit_s`` (all its forwards, cumulative) and ``async/old_logit_held_bytes``.

Behind sglang-router every request goes through the router (the client sees one "engine", and
re-admits it without an engine resync); pauses, continues and weight loads go to the engines
behind it directly (``control_urls``), never through the router.

Every finished sample is scored by the task's reward and, when its group is complete, the group is
pushed to the sample buffer actor. A sample whose request failed on every engine is re-queued at
top priority and counted (``async/sample_retries``): nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from training.engines.client import RolloutClient
from training.engines.rollout import (
    GenerateRequest,
    GenerateResult,
    RolloutEngineError,
    SamplingParams,
)
from training.evals import EvalResult, fingerprint
from training.recipe import Recipe
from training.runtime.interrupt_old import HeldPolicy
from training.runtime.pipeline import Dispatcher, StalenessController
from training.runtime.types import Group, RolloutState, Sample
from training.tasks.registry import Example, Task, get_task, stable_hash
from training.tasks.tokenizer import CharTokenizer
from training.tasks.tools import ToolTask

__all__ = ["Rollouter", "build_task", "example_for_group"]

log = logging.getLogger("asyncrl.runtime")


def build_task(recipe: Recipe) -> Task:
    """The recipe's task (seeded with the recipe seed)."""
    return get_task(recipe.task.name, seed=recipe.seed, **recipe.task.args)


def example_for_group(task: Task, recipe: Recipe, group_id: int) -> Example:
    """The training prompt of group ``group_id``: deterministic in (recipe seed, group id).

    The difficulty bucket is drawn first — by ``task.difficulty_weights`` when given, else
    uniformly over the task's buckets (a task without buckets draws from its whole split).
    """
    rng = random.Random(stable_hash(recipe.seed, "group", group_id))
    weights = recipe.task.difficulty_weights
    buckets = sorted(weights) if weights else task.difficulties()
    difficulty = None
    if buckets:
        w = [weights[b] for b in buckets] if weights else None
        difficulty = rng.choices(buckets, weights=w)[0]
    seed = rng.randrange(2**31)
    return task.examples("train", 1, seed=seed, difficulty=difficulty)[0]


@dataclass
class _Pending:
    """A submitted group being generated."""

    example: Example
    prompt_ids: list[int]
    submit_step: int
    samples: list[Sample | None] = field(default_factory=list)


@dataclass
class _Response:
    """One sample's response, joined from the requests that produced it (several when
    abort_resume interrupted it): tokens, their log-probs and weight versions, and the routed
    experts of every position whose next token was sampled — the rows of each piece that are new
    (a resumed request re-prefills the earlier tokens under newer weights; those rows are not
    the ones that sampled them)."""

    prompt_len: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    turn: int = 0
    finish_reason: str = "abort"
    _routes: list[np.ndarray] = field(default_factory=list)
    _route_rows: int = 0
    # old_logprob interrupt: π_old of output_ids[:len(old)]; requests sent / come back (a sync
    # waits for the ones sent before it); missing: some token's version had left (not expected)
    old: list[float] = field(default_factory=list)
    old_missing: bool = False
    sent: int = 0
    returned: int = 0

    def add(self, res: GenerateResult, moe: bool) -> None:
        """Append ``res``'s tokens; raises :class:`RolloutEngineError` (leaving the response
        as it was) when its log-probs, versions or routed experts do not cover them."""
        o = len(res.output_ids)
        if (res.output_logprobs is not None and len(res.output_logprobs) != o) or \
                len(res.output_token_weight_versions) != o:
            raise RolloutEngineError(
                f"engine returned {o} tokens with "
                f"{len(res.output_logprobs or [])} log-probs and "
                f"{len(res.output_token_weight_versions)} weight versions")
        if moe:
            # rows cover positions 0 .. P+O−2 of this request: keep from the first one not kept
            # yet (a resumed piece re-prefills earlier tokens; a tool observation's positions
            # were first computed by the request that follows it)
            start = self._route_rows
            end = self.prompt_len + len(self.output_ids) + len(res.output_ids) - 1
            routes = res.routed_experts
            if routes is None or len(routes) < end:
                raise RolloutEngineError(
                    f"engine returned {0 if routes is None else len(routes)} routed-expert rows "
                    f"for {res.prompt_tokens} prompt + {res.completion_tokens} output tokens, "
                    f"expected {end}; is --enable-return-routed-experts set?")
            self._routes.append(routes[start:end])
            self._route_rows = end
        self.output_ids += [int(t) for t in res.output_ids]
        self.logprobs += [float(x) for x in (res.output_logprobs or [])]
        self.versions += [int(v) for v in res.output_token_weight_versions]
        self.mask += [1] * o
        self.turn_ids += [self.turn] * o
        self.finish_reason = res.finish_reason

    def add_observation(self, ids: list[int]) -> None:
        """Append a tool observation: not the policy's tokens (loss mask 0, log-prob 0), with the
        version of the token before it and the turn it answers."""
        version = self.versions[-1] if self.versions else 0
        self.output_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.mask += [0] * len(ids)
        self.turn_ids += [self.turn] * len(ids)

    def routes(self) -> np.ndarray | None:
        return np.concatenate(self._routes) if self._routes else None


class Rollouter:
    """Generates groups into the sample buffer (see the module docstring).

    Args:
        recipe: the validated recipe (a frozen pydantic model; Ray pickles it as it is).
        urls: rollout engine base URLs.
        buffer: the sample buffer actor handle (``put`` / ``submitted`` remote methods) or a
            local object with async-compatible ``put`` / ``submitted``.
        start: resume state from :meth:`state` (None for a fresh run): next group id, groups to
            regenerate, policy step and version, controller and dispatcher state.
        version: the weight version the engines serve at start.
        control_urls: when ``urls`` is a router (sglang-router), the engines behind it: weight
            loads, pauses and continues go to them directly, never through the router. None:
            ``urls`` are the engines themselves.
        weights_path: the HF directory the engines serve at start (``version``); required by
            ``old_logprob: interrupt``, whose π_old copy loads it.
    """

    def __init__(self, recipe: Recipe, urls: list[str], buffer: Any,
                 start: RolloutState | None = None, version: int = 0,
                 control_urls: list[str] | None = None,
                 weights_path: str | None = None) -> None:
        self.recipe = recipe
        self.task = build_task(self.recipe)
        self.tokenizer = CharTokenizer()
        # a tool task's turns also stop at the closing character of a call
        self.call_close_id: int | None = None
        self.stop_ids: tuple[int, ...] = (self.tokenizer.eos_token_id,)
        if isinstance(self.task, ToolTask):
            self.call_close_id = self.tokenizer.encode(self.task.call_close)[0]
            self.stop_ids = (self.tokenizer.eos_token_id, self.call_close_id)
        self.urls = list(urls)
        self.control_urls = list(control_urls) if control_urls else None
        self.buffer = buffer
        r = self.recipe
        a = r.async_
        self.n = r.rollout.n
        self.controller = StalenessController(
            r.samples_per_step,
            staleness_threshold=a.quota_threshold,
            trigger_parameter_sync_step=a.sync_interval,
            max_ahead_steps=a.max_ahead_steps,
        )
        self.dispatcher = Dispatcher(r.data.dispatch, ema_alpha=r.data.length_ema)
        self.partial_rollout = a.partial_rollout
        self.interrupt = r.partial_interrupt  # retract | abort_resume | None
        self.max_in_flight = r.data.max_in_flight
        self.sync_timeout_s = 600.0
        # R3 needs the rollout's routes; the model is MoE (the recipe checks a warm start, the
        # run's start a checkpoint's config.json: `Recipe.is_moe` cannot see inside a checkpoint)
        self.moe = r.routing_replay == "r3"
        self.policy_step = 0
        self.version = int(version)
        self.next_group_id = 0
        self._regen: list[int] = []
        if start is not None:
            self.next_group_id = start.next_group_id
            self._regen = list(start.regenerate)
            self.policy_step = start.policy_step
            self.controller.load_state_dict(start.controller)
            self.dispatcher.load_state_dict(start.dispatcher)
        self.client: RolloutClient | None = None  # generation (through the router, if any)
        self.control: RolloutClient | None = None  # weights, pause, continue (the engines)
        self._groups: dict[int, _Pending] = {}
        self._in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._syncing = False
        self._stopping = False
        self._error: str | None = None
        # counters (async/*)
        self._t0 = time.monotonic()
        self._idle = 0.0
        self._idle_since: float | None = time.monotonic()
        self.counters = dict(samples_generated=0, tokens_generated=0, sample_retries=0,
                             groups_completed=0, partial_samples=0, syncs=0,
                             resumed_requests=0, tool_calls=0, tool_errors=0, tool_timeouts=0)
        self._sync_times: list[float] = []
        self._wait_times: list[float] = []
        # old_logprob interrupt: the served policy's copy, the samples in flight, timings
        self.held: HeldPolicy | None = None
        if r.algorithm.effective_old_logprob == "interrupt":
            if weights_path is None:
                raise ValueError("old_logprob: interrupt needs the served weights' directory: "
                                 "pass weights_path")
            import torch  # only π_old's copy needs torch here: other runs skip its import

            torch.set_num_threads(1)
            self.held = HeldPolicy(weights_path, self.version, r.rollout.temperature)
            self.counters["old_logit_missing"] = 0
        self._live: dict[tuple[int, int], _Response] = {}
        self._old_lock = asyncio.Lock()
        self._old_s = 0.0
        self._interrupt_s = 0.0

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> bool:
        """Open the client and start generating (idempotent)."""
        if self._loop_task is None:
            self.client = RolloutClient(self.urls, health_interval_s=0.5,
                                        resync=self.control_urls is None)
            await self.client.start()
            self.control = self.client
            if self.control_urls is not None:
                self.control = RolloutClient(self.control_urls, health_interval_s=0.5)
                await self.control.start()
            self._wake = asyncio.Event()
            self._loop_task = asyncio.create_task(self._loop())
        return True

    async def stop(self) -> bool:
        """Stop generating, cancel in-flight requests, close the client."""
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        for t in list(self._tasks):
            t.cancel()
        if self._loop_task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._loop_task, timeout=5)
        if self.client is not None:
            await self.client.close()
        if self.control is not None and self.control is not self.client:
            await self.control.close()
        return True

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # --- main loop ----------------------------------------------------------------------------
    def _mark_busy_state(self) -> None:
        now = time.monotonic()
        if self._in_flight == 0:
            if self._idle_since is None:
                self._idle_since = now
        elif self._idle_since is not None:
            self._idle += now - self._idle_since
            self._idle_since = None

    async def _loop(self) -> None:
        assert self._wake is not None
        try:
            while not self._stopping:
                self._wake.clear()
                if not self._syncing:
                    await self._submit_allowed()
                if not self._syncing and not self._stopping:  # a sync may start while submitting
                    self._dispatch_ready()
                self._mark_busy_state()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
        except Exception as e:
            self._error = f"rollouter loop failed: {type(e).__name__}: {e}"
            log.exception("rollouter loop failed")

    async def _submit_allowed(self) -> None:
        while self._regen:  # groups in flight when the checkpoint was taken: regenerate them
            await self._submit(self._regen.pop(0), count=False)
        while not self._syncing and self.controller.can_submit(self.n, self.policy_step):
            gid = self.next_group_id
            self.next_group_id += 1
            await self._submit(gid, count=True)

    async def _submit(self, gid: int, count: bool) -> None:
        example = example_for_group(self.task, self.recipe, gid)
        prompt_ids = self.tokenizer.encode(example.prompt, add_bos=True)
        self._groups[gid] = _Pending(example, prompt_ids, self.policy_step, [None] * self.n)
        if count:  # a regenerated group was counted and registered with the buffer already
            self.controller.on_submit(self.n)
            sub = self.buffer.submitted
            await (sub.remote(gid) if hasattr(sub, "remote") else sub(gid))
        self.dispatcher.add_group(gid, example.id, self.n)

    def _dispatch_ready(self) -> None:
        while self._in_flight < self.max_in_flight:
            item = self.dispatcher.pop()
            if item is None:
                return
            gid, idx = item
            self._in_flight += 1
            task = asyncio.create_task(self._run_sample(gid, idx))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _request(self, gid: int, idx: int, attempt: int,
                 done: list[int] | None = None, turn: int = 0) -> GenerateRequest:
        """The request for sample ``idx`` of group ``gid``; ``done``: response tokens so far (an
        interrupted request's, abort_resume, and earlier turns with their tool observations),
        sent after the prompt."""
        pend = self._groups[gid]
        r = self.recipe.rollout
        done = done or []
        sampling = SamplingParams(
            max_new_tokens=r.max_response_tokens - len(done), temperature=r.temperature,
            top_p=r.top_p, stop_token_ids=self.stop_ids,
            seed=(stable_hash(self.recipe.seed, "sample", gid, idx, attempt) if turn == 0 else
                  stable_hash(self.recipe.seed, "sample", gid, idx, attempt, "turn", turn))
            % 2**31)
        expected = self.dispatcher.expected_length(pend.example.id)
        return GenerateRequest(input_ids=pend.prompt_ids + done, sampling=sampling,
                               return_routed_experts=self.moe,
                               expected_new_tokens=None if expected is None else
                               max(1, int(expected) + 1 - len(done)))

    async def _generate_turn(self, gid: int, idx: int, response: _Response,
                             attempt: int) -> tuple[int, GenerateResult]:
        """Generate one model turn of sample ``idx`` of group ``gid`` onto ``response``: until a
        stop token (<eos>, or a tool call's closing character for a tool task) or the token
        limit, across engine failures (retried on another engine) and syncs (abort_resume: the
        interrupted piece is kept and the rest asked for under the new weights). ``attempt``
        counts requests sent for the sample; returns it and the last result."""
        limit = self.recipe.rollout.max_response_tokens
        while True:
            attempt += 1
            assert self.client is not None
            syncs = self.counters["syncs"]
            response.sent += 1
            try:
                res = (await self.client.generate_one(self._request(
                    gid, idx, attempt, response.output_ids, response.turn)))[0]
            except RolloutEngineError as e:
                response.returned += 1
                self.counters["sample_retries"] += 1
                log.warning("sample %d/%d failed on every engine (%s); retrying", gid, idx, e)
                await asyncio.sleep(min(2.0, 0.2 * attempt))
                continue
            # no await from here until its tokens are in the response: a sync waiting for it
            # sees both at once
            response.returned += 1
            if res.aborted and self.interrupt != "abort_resume":
                # an engine dropped it mid-way (retract mode): redo the turn whole
                self.counters["sample_retries"] += 1
                continue
            kept = len(response.output_ids)
            if res.output_ids or not res.aborted:
                try:
                    response.add(res, self.moe)
                except RolloutEngineError as e:
                    # e.g. SGLang: a request retracted under KV-cache pressure and aborted
                    # while queued returns its tokens without routed experts, which R3
                    # needs: that piece is generated again
                    self.counters["sample_retries"] += 1
                    log.warning("sample %d/%d: %s; generating that part again", gid, idx, e)
                    await asyncio.sleep(min(2.0, 0.2 * attempt))
                    continue
            if not res.aborted:
                return attempt, res
            # abort_resume: interrupted by a sync (or an engine going down); the tokens are
            # kept, and the rest is asked for under the weights the engines hold once the
            # sync is over
            if len(response.output_ids) > kept and response.output_ids[-1] in self.stop_ids:
                response.finish_reason = "stop"  # it ended as it was aborted
                return attempt, res
            if len(response.output_ids) >= limit:
                response.finish_reason = "length"
                return attempt, res
            if len(response.output_ids) == kept and not self._syncing \
                    and self.counters["syncs"] == syncs:
                # aborted with nothing new and no sync since it was sent: the engine
                # refused it (e.g. SGLang aborts a request it cannot admit)
                self.counters["sample_retries"] += 1
                log.warning("sample %d/%d was aborted by the engine (%s); retrying", gid,
                            idx, res.finish_detail.get("message", "no message"))
                await asyncio.sleep(min(2.0, 0.2 * attempt))
            while self._syncing and not self._stopping:
                await asyncio.sleep(0.005)
            if response.output_ids:
                self.counters["resumed_requests"] += 1

    async def _run_sample(self, gid: int, idx: int) -> None:
        pend = self._groups[gid]
        submitted = time.time()
        response = _Response(len(pend.prompt_ids))
        self._live[(gid, idx)] = response
        r = self.recipe.rollout
        limit = r.max_response_tokens
        tools = self.task if isinstance(self.task, ToolTask) else None
        calls = errors = timeouts = 0
        try:
            attempt, res = 0, None
            while True:  # one model turn, then (tool tasks) the tool's observation
                turn_start = len(response.output_ids)
                attempt, res = await self._generate_turn(gid, idx, response, attempt)
                ids = response.output_ids
                if tools is None or response.finish_reason != "stop" or not ids or \
                        ids[-1] != self.call_close_id:
                    break
                if response.turn + 1 >= r.max_turns or len(ids) >= limit:
                    response.finish_reason = "length"  # no turn left for the answer
                    break
                outcome = await asyncio.to_thread(
                    tools.observe, self.tokenizer.decode(ids[turn_start:]), r.tool_timeout_s)
                calls += 1
                errors += outcome.status == "error"
                timeouts += outcome.status == "timeout"
                observation = self.tokenizer.encode(outcome.observation)
                response.add_observation(observation[:limit - len(ids)])
                if len(response.output_ids) >= limit:
                    response.finish_reason = "length"
                    break
                response.turn += 1
                if self.partial_rollout:  # the next turn starts under the weights being loaded
                    while self._syncing and not self._stopping:
                        await asyncio.sleep(0.005)
            assert res is not None
            if self.held is not None:  # the rest of its tokens: their version is still served
                await self._fill_old([(pend.prompt_ids, response)])
            text = self.tokenizer.decode(response.output_ids)
            reward = self.task.reward(pend.example, text)
            sample = Sample(
                group_id=gid, sample_index=idx, prompt_id=pend.example.id,
                prompt_ids=list(pend.prompt_ids), response_ids=list(response.output_ids),
                rollout_log_probs=list(response.logprobs),
                token_versions=list(response.versions),
                loss_mask=list(response.mask), reward=float(reward),
                difficulty=pend.example.difficulty, finish_reason=response.finish_reason,
                routes=response.routes() if self.moe else None, engine_url=res.engine_url,
                submitted_at=submitted, finished_at=time.time(), attempts=attempt,
                turn_ids=list(response.turn_ids) if tools is not None else [],
                tool_calls=calls, tool_errors=errors, tool_timeouts=timeouts,
                old_log_probs=list(response.old) if self.held is not None
                and not response.old_missing else [])
            self.counters["samples_generated"] += 1
            self.counters["tokens_generated"] += sum(response.mask)
            self.counters["tool_calls"] += calls
            self.counters["tool_errors"] += errors
            self.counters["tool_timeouts"] += timeouts
            if sample.spans_sync:
                self.counters["partial_samples"] += 1
            self.dispatcher.complete(gid, idx, len(response.output_ids))
            pend.samples[idx] = sample
            if all(s is not None for s in pend.samples):
                group = Group(group_id=gid, prompt_id=pend.example.id,
                              difficulty=pend.example.difficulty, answer=pend.example.answer,
                              submit_step=pend.submit_step,
                              samples=[s for s in pend.samples if s is not None],
                              completed_at=time.time())
                self.counters["groups_completed"] += 1
                put = self.buffer.put
                await (put.remote(group) if hasattr(put, "remote") else put(group))
                # only now: until the buffer holds it, a checkpoint lists it to regenerate
                del self._groups[gid]
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._error = f"sample {gid}/{idx} failed: {type(e).__name__}: {e}"
            log.exception("sample failed")
        finally:
            self._live.pop((gid, idx), None)
            self._in_flight -= 1
            self._mark_busy_state()
            self._poke()

    # --- weight sync --------------------------------------------------------------------------
    async def sync_weights(self, path: str, version: int, step: int,
                           consumed_samples: int) -> dict[str, float]:
        """Load ``path`` (weight ``version``, trainer ``step``) on every engine.

        Partial rollout: pause (``retract``, or ``abort`` for abort_resume) → load → continue;
        in-flight samples keep their tokens.
        Otherwise: stop dispatching, wait for the in-flight requests, load, resume.
        ``consumed_samples`` (trained + dropped so far) sets the next rollout_num quota.
        Returns ``async/sync_wait_s`` (waiting for generation to stop) and
        ``async/weight_sync_s`` (loading the weights on the engines).

        It is :meth:`begin_weight_sync`, the load on every engine (directly, also behind a
        router), then :meth:`end_weight_sync`.
        """
        assert self.control is not None
        wait_s = await self.begin_weight_sync()
        try:
            t1 = time.monotonic()
            results = await self.control.update_weights_from_disk(path, version)
            if not any(r.success for r in results):
                raise RolloutEngineError("no engine loaded the new weights: " + "; ".join(
                    f"{r.engine_url}: {r.message}" for r in results))
        except BaseException:
            self._syncing = False
            raise
        return await self.end_weight_sync(version, step, consumed_samples, wait_s,
                                          time.monotonic() - t1, path=path)

    async def begin_weight_sync(self) -> float:
        """Stop generation for a weight load done by someone else (the driver through each
        engine, or a broadcast from the trainer): with partial rollout pause the engines
        (``retract``, or ``abort`` for abort_resume: the aborted requests are resumed after
        :meth:`end_weight_sync`), otherwise stop dispatching and wait for the in-flight
        requests. Returns the
        seconds waited. Follow with :meth:`end_weight_sync` once the engines hold the new weights;
        until then nothing new is dispatched."""
        assert self.control is not None
        self._syncing = True
        t0 = time.monotonic()
        self._interrupt_s = 0.0
        try:
            if self.partial_rollout:
                await self.control.pause_generation(
                    "abort" if self.interrupt == "abort_resume" else "retract")
                if self.held is not None:
                    t1 = time.monotonic()
                    await self._await_interrupted()
                    await self._fill_old([(self._groups[gid].prompt_ids, r)
                                          for (gid, _), r in list(self._live.items())])
                    self._interrupt_s = time.monotonic() - t1
            else:
                deadline = time.monotonic() + self.sync_timeout_s
                while self._in_flight > 0:
                    if time.monotonic() > deadline:
                        raise RolloutEngineError(
                            f"{self._in_flight} requests still running {self.sync_timeout_s:.0f} "
                            "s after the sync began; check the rollout engines' logs")
                    await asyncio.sleep(0.01)
        except BaseException:
            self._syncing = False
            raise
        return time.monotonic() - t0

    async def end_weight_sync(self, version: int, step: int, consumed_samples: int,
                              wait_s: float, load_s: float,
                              path: str | None = None) -> dict[str, float]:
        """The engines serve weight ``version`` (trainer ``step``) now: continue generation (partial
        rollout), resume dispatching, and account the sync like :meth:`sync_weights` —
        ``consumed_samples`` sets the next rollout_num quota, ``wait_s`` / ``load_s`` (from
        :meth:`begin_weight_sync` and the caller's load) are reported as ``async/sync_wait_s`` /
        ``async/weight_sync_s`` (the latter includes the continue call). ``path``: the
        directory the engines loaded, which ``old_logprob: interrupt``'s copy loads too (before
        generation continues; its stall is ``async/old_logit_interrupt_s``)."""
        assert self.control is not None
        t0 = time.monotonic()
        try:
            if self.held is not None:
                if path is None:
                    raise ValueError("old_logprob: interrupt loads each version from the "
                                     "exported weights: pass end_weight_sync the path loaded")
                async with self._old_lock:
                    await asyncio.to_thread(self.held.load, path, version)
                self._interrupt_s += time.monotonic() - t0
            if self.partial_rollout:
                await self.control.continue_generation()
        finally:
            self._syncing = False
        load_s = float(load_s) + (time.monotonic() - t0)
        wait_s = float(wait_s)
        self.version = int(version)
        self.policy_step = int(step)
        outstanding = self.controller.submitted_total - int(consumed_samples)
        quota = self.controller.on_sync(step, max(0, outstanding))
        self.counters["syncs"] += 1
        self._sync_times.append(load_s)
        self._wait_times.append(wait_s)
        self._poke()
        out = {"async/sync_wait_s": wait_s, "async/weight_sync_s": load_s,
               "async/rollout_quota": float(quota), "async/stale_outstanding": float(outstanding)}
        if self.held is not None:
            out["async/old_logit_interrupt_s"] = self._interrupt_s
        return out

    async def _await_interrupted(self) -> None:
        """Wait until every request of the samples in flight has come back, aborted with its
        tokens (or finished). A request still on its way when the engines paused is queued
        there, not aborted: the abort is repeated until it comes back too (a sample whose
        request was aborted sends the next one after the sync)."""
        assert self.control is not None
        deadline = time.monotonic() + self.sync_timeout_s
        again = time.monotonic() + 0.05
        while any(r.returned < r.sent for r in self._live.values()):
            now = time.monotonic()
            if now > deadline:
                raise RolloutEngineError(
                    f"aborted requests had not come back {self.sync_timeout_s:.0f} s after the "
                    "sync began; check the rollout engines' logs")
            if now >= again:
                await self.control.abort()
                again = now + 0.1
            await asyncio.sleep(0.002)

    async def _fill_old(self, rows: list[tuple[list[int], _Response]]) -> None:
        """π_old of the response tokens that have none yet, under the held copy (the version
        that generated them: the caller makes sure it is still the one served). A token of
        another version (not expected) leaves its sample without π_old, counted in
        ``async/rollouter/old_logit_missing``; tool observation tokens get 0.0."""
        assert self.held is not None
        async with self._old_lock:
            todo: list[tuple[list[int], _Response, int, int]] = []
            for prompt, r in rows:
                k, n = len(r.old), len(r.output_ids)
                if r.old_missing or k >= n:
                    continue
                if any(m and v != self.held.version
                       for m, v in zip(r.mask[k:n], r.versions[k:n], strict=True)):
                    r.old_missing = True
                    self.counters["old_logit_missing"] += 1
                    log.warning("a sample has tokens of versions %s without π_old (the copy "
                                "holds %d); it trains on the trainer's fallback",
                                sorted(set(r.versions[k:n])), self.held.version)
                    continue
                todo.append((list(prompt), r, k, n))
            if not todo:
                return
            t0 = time.monotonic()
            values = await asyncio.to_thread(
                self.held.log_probs, [p for p, _, _, _ in todo],
                [r.output_ids[:n] for _, r, _, n in todo], [k for _, _, k, _ in todo])
            self._old_s += time.monotonic() - t0
            for (_, r, k, n), row in zip(todo, values, strict=True):
                r.old += [lp if m else 0.0 for lp, m in zip(row, r.mask[k:n], strict=True)]

    async def set_policy_step(self, step: int, dropped_samples: int = 0) -> None:
        """The trainer finished a step (seed 004's i advances with every training step, not only
        at syncs); ``dropped_samples`` too-stale samples were discarded and are credited back so
        the limits do not count them as training data."""
        self.policy_step = max(self.policy_step, int(step))
        if dropped_samples:
            self.controller.on_dropped(int(dropped_samples))
        self._poke()

    # --- eval ---------------------------------------------------------------------------------
    async def evaluate(self, n: int) -> EvalResult:
        """Greedy generation on ``n`` held-out prompts (spread over the difficulties) with the
        engines' current weights; reward per difficulty bucket under ``eval/*``, and each
        prompt's reward for paired comparisons (:mod:`training.evals`)."""
        assert self.client is not None
        examples = self.task.examples("eval", n)
        r = self.recipe.rollout

        tools = self.task if isinstance(self.task, ToolTask) else None

        async def one(ex: Example) -> tuple[Example, float, int, bool]:
            prompt = self.tokenizer.encode(ex.prompt, add_bos=True)
            out: list[int] = []
            for turn in range(r.max_turns if tools is not None else 1):
                sampling = SamplingParams(max_new_tokens=r.max_response_tokens - len(out),
                                          temperature=0.0, stop_token_ids=self.stop_ids)
                req = GenerateRequest(input_ids=prompt + out, sampling=sampling,
                                      return_logprob=False)
                res = (await self.client.generate_one(req))[0]  # type: ignore[union-attr]
                start, out = len(out), out + list(res.output_ids)
                truncated = res.finish_reason == "length"
                if tools is None or truncated or not out or out[-1] != self.call_close_id:
                    break
                truncated = turn + 1 == r.max_turns
                if truncated:
                    break
                outcome = await asyncio.to_thread(tools.observe,
                                                  self.tokenizer.decode(out[start:]),
                                                  r.tool_timeout_s)
                out += self.tokenizer.encode(outcome.observation)
                if len(out) >= r.max_response_tokens:
                    out, truncated = out[:r.max_response_tokens], True
                    break
            text = self.tokenizer.decode(out)
            return ex, self.task.reward(ex, text), len(out), truncated

        rows = await asyncio.gather(*(one(ex) for ex in examples))
        out: dict[str, float] = {}
        result = EvalResult(out, fingerprint([ex.prompt for ex in examples]),
                            tuple(float(x[1]) for x in rows))
        if not rows:
            return result
        out["eval/reward_mean"] = sum(x[1] for x in rows) / len(rows)
        out["eval/response_length_mean"] = sum(x[2] for x in rows) / len(rows)
        out["eval/truncation_rate"] = sum(x[3] for x in rows) / len(rows)
        out["eval/n"] = float(len(rows))
        out["eval/weight_version"] = float(self.version)
        buckets: dict[int, list[float]] = {}
        for ex, rew, _, _ in rows:
            if ex.difficulty is not None:
                buckets.setdefault(ex.difficulty, []).append(rew)
        for d, vals in sorted(buckets.items()):
            out[f"eval/reward/d{d}"] = sum(vals) / len(vals)
        return result

    # --- state and stats ----------------------------------------------------------------------
    async def stats(self) -> dict[str, float]:
        """``async/*`` rollouter figures (cumulative) and the router's fault counters."""
        self._mark_busy_state()
        wall = max(time.monotonic() - self._t0, 1e-9)
        idle = self._idle + (time.monotonic() - self._idle_since if self._idle_since else 0.0)
        out = {f"async/rollouter/{k}": float(v) for k, v in self.counters.items()}
        out["async/rollouter_idle_ratio"] = min(1.0, idle / wall)
        out["async/in_flight_samples"] = float(self._in_flight)
        out["async/rollouter/quota"] = float(self.controller.quota)
        out["async/submitted_samples"] = float(self.controller.submitted_total)
        out["async/rollout_tokens_per_s"] = self.counters["tokens_generated"] / wall
        if self.held is not None:
            out["async/old_logit_s"] = self._old_s
            out["async/old_logit_held_bytes"] = float(self.held.nbytes)
        out.update(self.dispatcher.stats())
        if self.client is not None:
            st = self.client.stats()
            out["async/engine_retries"] = float(st.retries)
            out["async/engine_failed_attempts"] = float(st.failed_attempts)
            out["async/engine_ejections"] = float(st.ejections)
            out["async/engine_readmissions"] = float(st.readmissions)
            out["async/requests_lost"] = float(st.lost)
            out["async/engines_admitted"] = float(sum(
                1 for e in st.engines.values() if e.get("admitted")))
        return out

    async def error(self) -> str | None:
        """The first unexpected failure inside the actor, if any (the driver stops the run)."""
        return self._error

    async def state(self) -> RolloutState:
        """Resume state: the next group id, the groups still being generated (to regenerate),
        the policy step, controller and dispatcher state."""
        return RolloutState(next_group_id=self.next_group_id,
                            regenerate=sorted(set(self._groups) | set(self._regen)),
                            policy_step=self.policy_step,
                            controller=self.controller.state_dict(),
                            dispatcher=self.dispatcher.state_dict())

    async def ping(self) -> bool:
        return True
