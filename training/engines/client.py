"""One client and router for every rollout backend (embedded servers and SGLang servers).

``RolloutClient(urls)`` implements :class:`~training.engines.rollout.RolloutEngine` over any number
of engine URLs:

- **Load balancing by estimated outstanding tokens**: a request goes to the admitted engine with
  the fewest tokens in flight, counting prompt + max_new_tokens · n of every request it has not
  answered yet (ties: fewer requests, then round robin). A request with n > 1 stays on one engine.
- **Health checks**: every ``health_interval_s`` each engine's ``GET /health`` is polled; an
  admitted engine failing ``health_failures_to_eject`` checks in a row is ejected (no traffic).
- **Retry on another engine**: a request whose engine fails (connection refused or dropped,
  timeout, HTTP 5xx) is sent again to another admitted engine (up to ``max_attempts`` sends).
  A transport failure ejects that engine at once; repeated 5xx answers eject it after
  ``failures_to_eject`` in a row. An HTTP 4xx is the request's fault: it raises
  :class:`EngineRequestError` at once, with no retry, and counts against neither the engine's
  health nor its ejection (it is counted as ``rejected``). A retried request starts over: the
  partial output of a dead engine is lost with it.
- **Re-admission**: an ejected engine whose ``/health`` is 200 again is re-admitted — after the
  router re-sends the last weights it pushed (``update_weights_from_disk``) if the engine reports
  another version, and re-applies a pause in force, so a restarted engine never serves stale
  weights. With ``resync=False`` (the URL is a router such as sglang-router, not an engine) it is
  re-admitted as soon as its ``/health`` answers: the engines behind it are brought back by
  whoever manages them.
- **Counters** (:meth:`RolloutClient.stats`): requests, completed, rejected (4xx), lost,
  cancelled, retries, failed attempts, ejections, readmissions, weight resyncs — every request
  ends as exactly one of completed / rejected / lost / cancelled; per engine: admitted, in-flight
  requests, outstanding tokens, requests sent, completed, rejected, failures, ejections,
  readmissions.

Unlike SGLang's own router (which rewrites request bodies and drops ``return_routed_experts``),
this one forwards the ``/generate`` body untouched, so R3 routing replay works through it.
Fan-out calls (weights, pause/continue, abort, flush) go to every admitted engine.

Transport: aiohttp, one connection pool per client. Measured in the rollouter of
``benchmarks/async_speedup.py`` (py-spy, 2026-11-26): with httpx, ~70 % of the rollouter's CPU
went to httpcore's connection pool, which checks every pooled connection's socket on every
request — O(connections) per request with 64 requests in flight.

``SyncRolloutClient`` wraps it for blocking code: same methods, run on a private event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Awaitable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from training.engines.rollout import (
    PAUSE_MODES,
    EngineRequestError,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    PauseMode,
    RolloutEngineError,
    WeightUpdateResult,
    weight_version_label,
)

log = logging.getLogger("asyncrl.client")
T = TypeVar("T")


class NoHealthyEngineError(RolloutEngineError):
    """Every engine is ejected and none came back in time."""


# what a send that never got an HTTP answer raises: refused or dropped connection, timeout
TransportError = (aiohttp.ClientError, TimeoutError, OSError)

# idle pooled connections are closed before a server's keep-alive timeout (uvicorn's default,
# used by the embedded server and SGLang, is 5 s) can close them under a request being sent
_KEEPALIVE_S = 2.0


@dataclass(frozen=True)
class Reply:
    """One HTTP answer, read whole."""

    status: int
    body: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class EngineState:
    """The router's view of one engine (counters are cumulative)."""

    url: str
    admitted: bool = True
    in_flight: int = 0
    outstanding_tokens: int = 0
    requests: int = 0
    completed: int = 0
    rejected: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    health_failures: int = 0
    ejections: int = 0
    readmissions: int = 0
    last_error: str | None = None


@dataclass(frozen=True)
class RouterStats:
    """A snapshot of the router's counters.

    requests: generate requests accepted by the client (one per GenerateRequest / raw body).
    completed: requests answered.
    rejected: requests an engine refused as malformed (HTTP 4xx; raised as EngineRequestError,
        never retried).
    lost: requests that failed on every attempt or found no healthy engine (raised).
    cancelled: requests whose caller cancelled them before an answer.
    Once no request is in progress: requests = completed + rejected + lost + cancelled.
    retries: sends beyond a request's first.
    failed_attempts: sends that failed on an engine (transport error, HTTP 5xx, unreadable
        answer).
    ejections / readmissions: engine state changes; resyncs: weights re-sent on readmission.
    engines: per-engine :class:`EngineState` as dicts.
    """

    requests: int
    completed: int
    rejected: int
    lost: int
    cancelled: int
    retries: int
    failed_attempts: int
    ejections: int
    readmissions: int
    resyncs: int
    engines: dict[str, dict[str, Any]]


class RolloutClient:
    """Async client + router over engine URLs (see the module docstring).

    Args:
        urls: engine base URLs (``http://host:port``).
        health_interval_s: period of the health checks.
        health_timeout_s: timeout of one health check.
        health_failures_to_eject: failed checks in a row that eject an admitted engine.
        failures_to_eject: HTTP 5xx answers in a row that eject an engine.
        max_attempts: sends of one request before it is lost (raised).
        request_timeout_s: read timeout of one ``/generate`` (long: paused requests wait).
        connect_timeout_s: connect timeout.
        wait_for_engine_s: how long a request waits for an engine when none is admitted.
        moe_layout: (num_layers, top_k) to decode routed experts; read from ``/model_info``
            (or ``config.json`` at the served model path) when None.
        resync: bring a re-admitted URL to the last pushed weights and pause state (engines);
            False for a router URL, which has no weights and no pause of its own.
    """

    def __init__(self, urls: Sequence[str], *, health_interval_s: float = 1.0,
                 health_timeout_s: float = 2.0, health_failures_to_eject: int = 2,
                 failures_to_eject: int = 3, max_attempts: int = 4,
                 request_timeout_s: float = 3600.0, connect_timeout_s: float = 3.0,
                 wait_for_engine_s: float = 60.0,
                 moe_layout: tuple[int, int] | None = None, resync: bool = True) -> None:
        if not urls:
            raise ValueError("RolloutClient needs at least one engine URL")
        clean = [u.rstrip("/") for u in urls]
        if len(set(clean)) != len(clean):
            raise ValueError(f"duplicate engine URLs in {clean}")
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.engines = {u: EngineState(u) for u in clean}
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.health_failures_to_eject = health_failures_to_eject
        self.failures_to_eject = failures_to_eject
        self.max_attempts = max_attempts
        self.wait_for_engine_s = wait_for_engine_s
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s,
                                              sock_read=request_timeout_s)
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        self._moe_layout = moe_layout
        self.resync = resync
        self._http: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._admitted_event: asyncio.Event | None = None
        self._layout_lock: asyncio.Lock | None = None
        self._rr = itertools.count()
        self._weights: tuple[str, int] | None = None  # last pushed (path, version)
        self._paused: str | None = None
        self._counters = dict(requests=0, completed=0, rejected=0, lost=0, cancelled=0,
                              retries=0, failed_attempts=0, ejections=0, readmissions=0,
                              resyncs=0)

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> RolloutClient:
        """Open the HTTP pool and start the health checks (idempotent; ``generate`` calls it)."""
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(
                    limit=4096, keepalive_timeout=_KEEPALIVE_S))
            self._admitted_event = asyncio.Event()
            self._layout_lock = asyncio.Lock()
            self._admitted_event.set()
            self._health_task = asyncio.create_task(self._health_loop())
        return self

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> RolloutClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- RolloutEngine -----------------------------------------------------------------------
    async def generate(self, requests: Sequence[GenerateRequest]) -> list[list[GenerateResult]]:
        """Send every request concurrently; result i holds requests[i]'s n samples in order."""
        return list(await asyncio.gather(*(self.generate_one(r) for r in requests)))

    async def generate_one(self, request: GenerateRequest) -> list[GenerateResult]:
        layout = await self._layout() if request.return_routed_experts else None
        body, url = await self.generate_raw(request.to_sglang(), request.estimated_tokens)
        outs = body if isinstance(body, list) else [body]
        return [GenerateResult.from_sglang(o, request.input_ids, layout, url) for o in outs]

    async def generate_raw(self, payload: dict[str, Any],
                           estimated_tokens: int | None = None) -> tuple[Any, str]:
        """Route one raw SGLang ``/generate`` body (forwarded untouched) → (JSON answer, URL).

        The body is not validated here (the engine does that): an engine's HTTP 4xx raises
        :class:`EngineRequestError` at once, without a retry or an ejection. Raises TypeError
        when ``payload`` is not a JSON-serialisable dict (nothing is sent or counted).
        """
        if not isinstance(payload, dict):
            raise TypeError(f"payload must be a dict (the /generate JSON body), got "
                            f"{type(payload).__name__}")
        try:
            content = json.dumps(payload, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise TypeError(f"payload is not JSON-serialisable: {e}") from None
        await self.start()
        est = estimated_tokens if estimated_tokens is not None else _estimate_tokens(payload)
        self._counters["requests"] += 1
        try:
            return await self._send_generate(content, est)
        except asyncio.CancelledError:
            self._counters["cancelled"] += 1
            raise
        except RolloutEngineError:  # counted (rejected / lost) where raised
            raise
        except Exception:
            self._counters["lost"] += 1
            raise

    async def _send_generate(self, content: bytes, est: int) -> tuple[Any, str]:
        """Send one encoded body until an engine answers (see :meth:`generate_raw`)."""
        tried: set[str] = set()
        last_error = "no attempt"
        for attempt in range(self.max_attempts):
            if attempt:
                self._counters["retries"] += 1
            try:
                engine = await self._pick(tried)
            except NoHealthyEngineError:
                self._counters["lost"] += 1
                raise
            tried.add(engine.url)
            engine.in_flight += 1
            engine.outstanding_tokens += est
            engine.requests += 1
            try:
                resp = await self._post(engine.url + "/generate", content)
            except TransportError as e:  # connection refused / dropped, timeout
                last_error = f"{type(e).__name__}: {e}"
                self._attempt_failed(engine, last_error, eject=True)
                continue
            finally:
                engine.in_flight -= 1
                engine.outstanding_tokens -= est
            if 400 <= resp.status < 500:  # the request's fault: the engine is fine
                engine.consecutive_failures = 0
                engine.rejected += 1
                self._counters["rejected"] += 1
                raise EngineRequestError(f"{engine.url} rejected the request (HTTP "
                                         f"{resp.status}): {_error_message(resp)}")
            answer = _json_or_none(resp) if resp.is_success else None
            if answer is None:
                last_error = f"HTTP {resp.status}: {resp.text[:200]}"
                eject = engine.consecutive_failures + 1 >= self.failures_to_eject
                self._attempt_failed(engine, last_error, eject=eject)
                continue
            engine.consecutive_failures = 0
            engine.completed += 1
            self._counters["completed"] += 1
            return answer, engine.url
        self._counters["lost"] += 1
        raise RolloutEngineError(f"request failed on {self.max_attempts} attempts (engines "
                                 f"tried: {sorted(tried)}); last error: {last_error}")

    async def update_weights_from_disk(self, path: str, version: int,
                                       abort_all_requests: bool = False
                                       ) -> list[WeightUpdateResult]:
        """Load ``path`` on every admitted engine as ``version``; remembered for resyncs when at
        least one engine loaded it. An engine that cannot be reached, or that answered with a
        failure while others succeeded, is ejected (it is resynced on readmission)."""
        body = {"model_path": str(path), "weight_version": weight_version_label(int(version)),
                "abort_all_requests": abort_all_requests}
        answers = await self._broadcast("/update_weights_from_disk", body)
        results = []
        for url, resp in answers.items():
            if isinstance(resp, Exception):
                results.append(WeightUpdateResult(False, f"unreachable: {resp}", url))
                continue
            data = _json_or_none(resp) or {}
            ok = bool(data.get("success", resp.is_success))
            results.append(WeightUpdateResult(ok, str(data.get("message", resp.text[:200])), url))

        if any(r.success for r in results):
            # the fleet moved to `version`: an engine that kept its old weights must not serve;
            # eject it, and the readmission resync loads these weights before it gets traffic
            self._weights = (str(path), int(version))
            for r in results:
                if not r.success and r.engine_url in self.engines \
                        and not r.message.startswith("unreachable"):
                    self._eject(self.engines[r.engine_url], f"weight update failed: {r.message}")
        return results

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        self._paused = mode
        self._raise_on_error(await self._broadcast("/pause_generation", {"mode": mode}))

    async def continue_generation(self) -> None:
        self._paused = None
        self._raise_on_error(await self._broadcast("/continue_generation", {}))

    async def abort(self, rid: str | None = None) -> None:
        body = {"abort_all": True} if rid is None else {"rid": rid}
        self._raise_on_error(await self._broadcast("/abort_request", body))

    async def flush_cache(self) -> None:
        self._raise_on_error(await self._broadcast("/flush_cache", {}))

    async def health(self) -> bool:
        """True when at least one engine answers ``/health`` with 200."""
        return any((await self.health_all()).values())

    async def health_all(self) -> dict[str, bool]:
        await self.start()
        oks = await asyncio.gather(*(self._probe(u) for u in self.engines))
        return dict(zip(self.engines, oks, strict=True))

    async def model_info(self) -> ModelInfo:
        """``/model_info`` of an admitted engine."""
        await self.start()
        errors = []
        for e in self._admitted() or list(self.engines.values()):
            try:
                resp = await self._get(e.url + "/model_info")
                if resp.status == 404:
                    resp = await self._get(e.url + "/get_model_info")
                if not resp.is_success:
                    errors.append(f"{e.url}: HTTP {resp.status}: {_error_message(resp)}")
                    continue
                return ModelInfo.from_dict(resp.json())
            except (*TransportError, ValueError) as err:
                errors.append(f"{e.url}: {type(err).__name__}: {err}")
        raise RolloutEngineError(f"no engine answered /model_info ({'; '.join(errors)})")

    def stats(self) -> RouterStats:
        return RouterStats(**self._counters,
                           engines={u: asdict(e) for u, e in self.engines.items()})

    # --- routing -----------------------------------------------------------------------------
    def _admitted(self) -> list[EngineState]:
        return [e for e in self.engines.values() if e.admitted]

    async def _pick(self, tried: set[str]) -> EngineState:
        """The admitted engine with the fewest outstanding tokens, preferring untried ones."""
        deadline = time.monotonic() + self.wait_for_engine_s
        while True:
            admitted = self._admitted()
            if admitted:
                fresh = [e for e in admitted if e.url not in tried] or admitted
                tick = next(self._rr)
                order = {e.url: (i - tick) % len(fresh) for i, e in enumerate(fresh)}
                return min(fresh, key=lambda e: (e.outstanding_tokens, e.in_flight,
                                                 order[e.url]))
            self._admitted_event.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoHealthyEngineError(
                    f"no healthy rollout engine among {list(self.engines)} for "
                    f"{self.wait_for_engine_s:.0f} s; start one or check their logs")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._admitted_event.wait(), timeout=left)

    def _attempt_failed(self, engine: EngineState, error: str, eject: bool) -> None:
        self._counters["failed_attempts"] += 1
        engine.failures += 1
        engine.consecutive_failures += 1
        engine.last_error = error
        log.warning("rollout engine %s failed a request: %s", engine.url, error)
        if eject:
            self._eject(engine, error)

    def _eject(self, engine: EngineState, reason: str) -> None:
        if engine.admitted:
            engine.admitted = False
            engine.ejections += 1
            self._counters["ejections"] += 1
            log.warning("ejected rollout engine %s (%s)", engine.url, reason)

    # --- health ------------------------------------------------------------------------------
    async def _probe(self, url: str) -> bool:
        try:
            return (await self._get(url + "/health")).status == 200
        except TransportError:
            return False

    async def _health_loop(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._check(e) for e in self.engines.values()))
            except Exception:  # a health round must never end the loop
                log.exception("health check round failed")
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, engine: EngineState) -> None:
        ok = await self._probe(engine.url)
        if engine.admitted:
            engine.health_failures = 0 if ok else engine.health_failures + 1
            if engine.health_failures >= self.health_failures_to_eject:
                self._eject(engine, f"{engine.health_failures} failed health checks")
        elif ok and await self._resync(engine):
            engine.admitted = True
            engine.health_failures = 0
            engine.consecutive_failures = 0
            engine.readmissions += 1
            self._counters["readmissions"] += 1
            self._admitted_event.set()
            log.warning("re-admitted rollout engine %s", engine.url)

    async def _resync(self, engine: EngineState) -> bool:
        """Bring a returning engine to the fleet's weights and pause state; False to keep it
        ejected for now."""
        if not self.resync:  # a router: nothing of its own to bring back
            return True
        try:
            if self._weights is not None:
                path, version = self._weights
                info = await self._get(engine.url + "/model_info")
                current = ModelInfo.from_dict(info.json()).weight_version
                if current != version:
                    resp = await self._post_json(engine.url + "/update_weights_from_disk", {
                        "model_path": path, "weight_version": weight_version_label(version)})
                    data = _json_or_none(resp) or {}
                    if not data.get("success", False):
                        engine.last_error = f"resync failed: {data.get('message', resp.text)}"
                        return False
                    self._counters["resyncs"] += 1
            if self._paused is not None:
                resp = await self._post_json(engine.url + "/pause_generation",
                                             {"mode": self._paused})
            else:  # it may have missed the fleet's continue while it was ejected
                resp = await self._post_json(engine.url + "/continue_generation", {})
            if not resp.is_success:
                engine.last_error = f"resync failed: HTTP {resp.status}: {_error_message(resp)}"
                return False
        except (*TransportError, RolloutEngineError, ValueError) as e:
            engine.last_error = f"resync failed: {e}"
            return False
        return True

    # --- HTTP --------------------------------------------------------------------------------
    async def _post(self, url: str, content: bytes) -> Reply:
        async with self._http.post(url, data=content,
                                   headers={"content-type": "application/json"}) as resp:
            return Reply(resp.status, await resp.read())

    async def _post_json(self, url: str, body: dict[str, Any]) -> Reply:
        return await self._post(url, json.dumps(body).encode())

    async def _get(self, url: str) -> Reply:
        """A short control-plane GET (health, model info), under the health timeout."""
        async with self._http.get(url, timeout=self._health_timeout) as resp:
            return Reply(resp.status, await resp.read())

    # --- fan-out -----------------------------------------------------------------------------
    async def _broadcast(self, path: str, body: dict[str, Any]
                         ) -> dict[str, Reply | Exception]:
        await self.start()
        targets = self._admitted()
        if not targets:
            raise NoHealthyEngineError(f"no admitted engine to send {path} to "
                                       f"(engines: {list(self.engines)})")

        async def one(e: EngineState) -> Reply | Exception:
            try:
                return await self._post_json(e.url + path, body)
            except TransportError as err:
                self._eject(e, f"{path}: {err!r}")
                return err

        answers = await asyncio.gather(*(one(e) for e in targets))
        return {e.url: a for e, a in zip(targets, answers, strict=True)}

    @staticmethod
    def _raise_on_error(answers: dict[str, Reply | Exception]) -> None:
        bad = {u: (str(a) if isinstance(a, Exception) else f"HTTP {a.status}: "
                   f"{_error_message(a)}") for u, a in answers.items()
               if isinstance(a, Exception) or not a.is_success}
        reachable_ok = [a for a in answers.values() if not isinstance(a, Exception)]
        if any(not a.is_success for a in reachable_ok) or not reachable_ok:
            raise RolloutEngineError(f"engines failed: {bad}")

    async def _layout(self) -> tuple[int, int]:
        async with self._layout_lock:  # one /model_info for a burst of requests
            return await self._fetch_layout()

    async def _fetch_layout(self) -> tuple[int, int]:
        if self._moe_layout is None:
            info = await self.model_info()
            layout = info.moe_layout or _layout_from_config(info.model_path)
            if layout is None:
                raise RolloutEngineError(
                    "return_routed_experts needs the MoE layout and the engine does not report "
                    "it; pass RolloutClient(..., moe_layout=(num_layers, top_k))")
            self._moe_layout = layout
        return self._moe_layout


class SyncRolloutClient:
    """Blocking facade of :class:`RolloutClient`: the same calls, run on a private event loop in
    a daemon thread. Use as a context manager or call :meth:`close`."""

    def __init__(self, urls: Sequence[str], **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client",
                                        daemon=True)
        self._thread.start()
        self.client = RolloutClient(urls, **kwargs)
        self._run(self.client.start())

    def _run(self, coro: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, requests: Sequence[GenerateRequest]) -> list[list[GenerateResult]]:
        return self._run(self.client.generate(requests))

    def generate_raw(self, payload: dict[str, Any]) -> tuple[Any, str]:
        return self._run(self.client.generate_raw(payload))

    def update_weights_from_disk(self, path: str, version: int,
                                 abort_all_requests: bool = False) -> list[WeightUpdateResult]:
        return self._run(self.client.update_weights_from_disk(path, version, abort_all_requests))

    def pause_generation(self, mode: PauseMode = "abort") -> None:
        self._run(self.client.pause_generation(mode))

    def continue_generation(self) -> None:
        self._run(self.client.continue_generation())

    def abort(self, rid: str | None = None) -> None:
        self._run(self.client.abort(rid))

    def flush_cache(self) -> None:
        self._run(self.client.flush_cache())

    def health(self) -> bool:
        return self._run(self.client.health())

    def health_all(self) -> dict[str, bool]:
        return self._run(self.client.health_all())

    def model_info(self) -> ModelInfo:
        return self._run(self.client.model_info())

    def stats(self) -> RouterStats:
        return self._run(_call(self.client.stats))

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self.client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _call(fn: Any) -> Any:
    return fn()


_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params omit it


def _estimate_tokens(payload: Any) -> int:
    """prompt + max_new_tokens · n for a raw body (text prompts count their characters).

    Load balancing only: never raises. A malformed body (the engine will answer 400) counts what
    can be read, with SGLang's defaults for the rest."""
    prompts = payload.get("input_ids") if isinstance(payload, dict) else None
    if prompts is None and isinstance(payload, dict):
        prompts = payload.get("text")
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], list | str):
        items = prompts
    else:
        items = [prompts]
    params = payload.get("sampling_params") if isinstance(payload, dict) else None
    params = params if isinstance(params, list) else [params] * len(items)
    total = 0
    for prompt, sp in zip(items, params, strict=False):
        sp = sp if isinstance(sp, dict) else {}
        total += (len(prompt) if isinstance(prompt, list | str) else 0) + (
            _positive_int(sp.get("max_new_tokens"), _DEFAULT_MAX_NEW_TOKENS)
            * _positive_int(sp.get("n"), 1))
    return total


def _positive_int(value: Any, default: int) -> int:
    if isinstance(value, int | float) and not isinstance(value, bool) and 1 <= value < 2**31:
        return int(value)
    return default


def _json_or_none(resp: Reply) -> Any:
    try:
        return resp.json()
    except (json.JSONDecodeError, ValueError):
        return None


def _error_message(resp: Reply) -> str:
    data = _json_or_none(resp)
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return resp.text[:300]


def _layout_from_config(model_path: str) -> tuple[int, int] | None:
    """(num_hidden_layers, num_experts_per_tok) from a local HF config.json, if readable."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        return int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"])
    except (OSError, KeyError, TypeError, ValueError):
        return None
