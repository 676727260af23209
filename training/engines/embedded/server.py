"""The embedded rollout server: SGLang's HTTP API (the subset RL uses) over the CPU engine loop.

Run it with ``asyncrl engine serve --checkpoint DIR --port P`` (or ``python -m
training.engines.embedded.server``). Endpoints, with SGLang 0.5.x field names:

- ``POST /generate``: ``input_ids`` (or ``text``; a list of either is a batch), ``sampling_params``
  (one object or one per batch item), ``return_logprob``, ``return_routed_experts``,
  ``routed_experts_start_len``, ``rid``, ``stream`` (SSE, single request with n = 1). Answers
  ``{text, output_ids, meta_info}``; a batch and/or n > 1 answers a list, request-major
  (item i's samples at i·n … i·n + n − 1). ``meta_info``: ``id``, ``finish_reason``,
  ``prompt_tokens``, ``completion_tokens``, ``weight_version``, ``output_token_weight_versions``,
  ``output_token_logprobs`` ([logprob, token_id, null] per token), ``routed_experts`` (base64
  int32, (P + O − 1 − start, L, k): every position whose next token was computed; (0, L, k)
  for a request aborted while still queued), ``e2e_latency``. A ``text`` prompt is tokenised
  with <bos> prepended. The whole body is validated before anything is queued: a malformed
  field answers HTTP 400 ``{"error": {"message"}}`` naming the field and the fix.
- ``POST /update_weights_from_disk`` {model_path, weight_version?, abort_all_requests?} →
  {success, message}; a bad path keeps the old weights (HTTP 400, success false).
- ``POST /init_weights_update_group`` {master_address, master_port, rank_offset, world_size,
  group_name, backend} → {success, message}: join a weight-broadcast group as rank
  ``rank_offset`` (gloo only: the server is CPU-only); ``POST /update_weights_from_distributed``
  {names, dtypes, shapes, group_name, weight_version?, flush_cache?}: receive those tensors by
  broadcast from rank 0 in list order and serve them (HF names; loaded as a checkpoint's would
  be, in the server precision), reporting ``weight_version`` when given
  (:mod:`training.engines.sglang.nccl_sync` is the sender); as in SGLang 0.5.23 only inside a
  session opened by ``POST /begin_weight_update`` and closed by ``POST /end_weight_update``.
- ``POST /pause_generation`` {mode: abort | retract | in_place}, ``POST /continue_generation``,
  ``POST /abort_request`` {rid | abort_all}, ``GET|POST /flush_cache`` (no prefix cache: no-op).
- ``GET /health``, ``GET /health_generate`` (a one-token generation), ``GET /model_info``
  (= ``/get_model_info``), ``GET /server_info`` (= ``/get_server_info``; engine counters under
  ``internal_states``), ``GET /v1/models``, ``GET /get_load``.

Departures from SGLang: weight versions are ints; an update applies between decode steps even to
running requests (their later tokens carry the new version), without waiting for them to finish;
input-token log-probs (``logprob_start_len``) are not returned; sampling parameters the engine
does not implement (penalties, min_p, grammars) are rejected unless left at their neutral value.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from training.engines.embedded.engine import RolloutEngineCore, Sequence, SequenceOutput
from training.engines.hf_io import CheckpointError, load_hf_dir
from training.engines.model import CausalLM
from training.engines.rollout import (
    PAUSE_MODES,
    SamplingParams,
    brief_repr,
    encode_routed_experts,
)
from training.engines.sampling import PrecisionConfig, SequenceRandom, apply_precision
from training.tasks.tokenizer import CharTokenizer


@dataclass(frozen=True)
class ServerConfig:
    """Options of ``asyncrl engine serve``.

    checkpoint: HF-format checkpoint directory (config.json + model.safetensors + tokenizer).
    host / port: where to listen (127.0.0.1 by default: the server has no authentication).
    dtype / logit_noise / seed: engine numerics (``training.engines.sampling``).
    max_batch: most sequences decoded together.
    threads: torch intra-op threads (1 keeps several servers and a trainer off each other's cores).
    served_model_name: name reported by ``/v1/models`` (default: the checkpoint directory name).
    """

    checkpoint: str
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "bf16"
    logit_noise: float = 0.0
    seed: int = 0
    max_batch: int = 64
    threads: int = 1
    served_model_name: str | None = None
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.threads < 1:
            raise ValueError("max_batch and threads must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")

    @property
    def precision(self) -> PrecisionConfig:
        return PrecisionConfig(dtype=self.dtype, logit_noise=self.logit_noise, seed=self.seed)


def load_for_serving(path: str | Path, precision: PrecisionConfig
                     ) -> tuple[CausalLM, CharTokenizer, int]:
    """Load a checkpoint in fp32 and put it into the engine precision (CheckpointError on a bad
    directory)."""
    ckpt = load_hf_dir(path, torch.float32)
    return apply_precision(ckpt.model, precision), ckpt.tokenizer, ckpt.weight_version


class ServerState:
    """Everything the routes share: the engine loop, tokenizer and server options."""

    def __init__(self, cfg: ServerConfig, core: RolloutEngineCore) -> None:
        self.cfg = cfg
        self.core = core
        self.model_path = str(Path(cfg.checkpoint).resolve())
        self.name = cfg.served_model_name or Path(self.model_path).name
        self.started = time.time()
        self.update_lock = asyncio.Lock()
        self.weight_groups: dict[str, Any] = {}  # /init_weights_update_group: name → group
        self.weight_session = False  # between /begin_weight_update and /end_weight_update

    @property
    def tokenizer(self) -> CharTokenizer:
        return self.core.tokenizer


def _version() -> str:
    try:
        return version("asyncrl")
    except PackageNotFoundError:
        return "0+unknown"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


# ------------------------------------------------------------------------------------------------
# /generate parsing and formatting
# ------------------------------------------------------------------------------------------------


@dataclass
class _Item:
    prompt: list[int]
    params: SamplingParams
    rid: str
    return_logprob: bool


@dataclass
class _GenerateBody:
    """A validated ``/generate`` body: nothing reaches the engine before all of it parsed."""

    items: list[_Item]
    batched: bool
    stream: bool
    return_routes: bool
    routes_start: int


_INPUT_IDS_SHAPE = "a list of token ids such as [1, 5, 6], or a list of such lists for a batch"


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for a batch of {count} prompts; "
                             "send one value, or one per prompt")
        return value
    return [value] * count


def _flag(value: Any, name: str) -> bool:
    """A JSON boolean field (null = false)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {brief_repr(value)}")
    return value


def _prompts(body: dict[str, Any], state: ServerState) -> tuple[list[list[int]], bool]:
    """→ (token-id prompts, batched) from ``input_ids`` or ``text``."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise ValueError("pass exactly one of input_ids or text")
    if has_text:
        raw = body["text"]
        if isinstance(raw, str):
            return [state.tokenizer.encode(raw, add_bos=True)], False
        if not (isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw)):
            raise ValueError(f"text must be a string or a non-empty list of strings, got "
                             f"{brief_repr(raw)}")
        return [state.tokenizer.encode(t, add_bos=True) for t in raw], True
    raw = body["input_ids"]
    if not isinstance(raw, list):
        raise ValueError(f"input_ids must be {_INPUT_IDS_SHAPE}; got {brief_repr(raw)}")
    batched = bool(raw) and isinstance(raw[0], list)
    prompts = raw if batched else [raw]
    vocab = state.core.config.vocab_size
    for i, prompt in enumerate(prompts):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"{where} must be a non-empty list of token ids; input_ids must be "
                             f"{_INPUT_IDS_SHAPE}")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"{where} holds {brief_repr(t)}: input_ids must be token ids "
                                 f"in [0, {vocab}) (the model's vocab_size)")
    return [list(p) for p in prompts], batched


def _rid(value: Any, index: int) -> str:
    if value is None:
        return uuid.uuid4().hex
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"rid must be a string (or a list of one per prompt), got "
                         f"{brief_repr(value)} for prompt {index}")
    return str(value)


def _parse_generate(body: Any, state: ServerState) -> _GenerateBody:
    """Validate a whole ``/generate`` body. Raises ValueError (HTTP 400) naming the field and the
    fix; nothing is queued until every field parsed."""
    cfg = state.core.config
    if not isinstance(body, dict):
        raise ValueError(f'the body must be a JSON object such as {{"input_ids": [1, 5], '
                         f'"sampling_params": {{}}}}, got {brief_repr(body)}')
    prompts, batched = _prompts(body, state)
    count = len(prompts)
    sampling = _per_item(body.get("sampling_params"), count, "sampling_params")
    params = [SamplingParams.from_sglang(p) for p in sampling]
    logprob = [_flag(v, "return_logprob")
               for v in _per_item(body.get("return_logprob"), count, "return_logprob")]
    rids = [_rid(v, i) for i, v in enumerate(_per_item(body.get("rid"), count, "rid"))]
    return_routes = _flag(body.get("return_routed_experts"), "return_routed_experts")
    start = body.get("routed_experts_start_len")
    start = 0 if start is None else start
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"routed_experts_start_len must be an integer >= 0 (the first position "
                         f"whose routes are returned; 0 = all), got {brief_repr(start)}")
    if return_routes and not cfg.is_moe:
        raise ValueError("return_routed_experts: the served model is dense (no experts); omit "
                         "it or serve an MoE checkpoint")
    if body.get("logprob_start_len") not in (None, -1):
        raise ValueError("logprob_start_len is not supported: input-token log-probs come from "
                         "the trainer; omit it")
    stream = _flag(body.get("stream"), "stream")
    if stream and (batched or params[0].n != 1):
        raise ValueError("stream supports one prompt with n = 1; send a batch or n > 1 without "
                         "stream")
    for i, prompt in enumerate(prompts):
        if len(prompt) >= cfg.max_position_embeddings:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens and leaves no room to "
                             f"generate: the context length is {cfg.max_position_embeddings}; "
                             "shorten it")
    items = [_Item(prompt, p, rid, lp)
             for prompt, p, lp, rid in zip(prompts, params, logprob, rids, strict=True)]
    return _GenerateBody(items, batched, stream, return_routes, start)


def _sequences(req: _GenerateBody, state: ServerState) -> list[Sequence]:
    core = state.core
    ctx = core.config.max_position_embeddings
    seqs = []
    for item in req.items:
        p = item.params
        base_seed = p.seed if p.seed is not None else core.new_seed()
        for j in range(p.n):
            seqs.append(Sequence(
                rid=item.rid if p.n == 1 else f"{item.rid}-{j}", group_rid=item.rid,
                prompt_ids=item.prompt, params=p,
                max_new_tokens=min(p.max_new_tokens, ctx - len(item.prompt)),
                rng=SequenceRandom(base_seed + j, core.precision.seed),
                return_routes=req.return_routes, routes_start=req.routes_start))
    return seqs


def _format(out: SequenceOutput, return_logprob: bool, final: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.rid, "finish_reason": out.finish if final else None,
        "prompt_tokens": len(out.prompt_ids), "completion_tokens": len(out.output_ids),
        "cached_tokens": 0, "weight_version": out.weight_version,
        "output_token_weight_versions": out.token_versions,
        "e2e_latency": out.finished - out.created,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                         zip(out.logprobs, out.output_ids, strict=True)]
    if out.routes is not None:
        meta["routed_experts"] = encode_routed_experts(out.routes)
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}


async def _wait_all(request: Request, seqs: list[Sequence], core: RolloutEngineCore
                    ) -> list[SequenceOutput] | None:
    """Await the sequences; abort them if the client goes away (→ None)."""
    pending = {asyncio.wrap_future(s.future) for s in seqs}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=1.0)
        if pending and await request.is_disconnected():
            for s in seqs:
                core.abort(s.rid)
            return None
    return [s.future.result() for s in seqs]


def _stream(seq: Sequence, item: _Item, core: RolloutEngineCore) -> StreamingResponse:
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def on_step(s: Sequence) -> None:  # engine thread: snapshot, then hand to the event loop
        snap = SequenceOutput(
            rid=s.rid, prompt_ids=s.prompt_ids, output_ids=list(s.output_ids),
            logprobs=list(s.logprobs), token_versions=list(s.token_versions), finish={},
            weight_version=s.token_versions[-1], routes=None,
            text=core.tokenizer.decode(s.output_ids), created=s.created, finished=time.time())
        loop.call_soon_threadsafe(updates.put_nowait, _format(snap, item.return_logprob, False))

    seq.on_step = on_step
    seq.future.add_done_callback(lambda _: loop.call_soon_threadsafe(updates.put_nowait, None))

    async def events():
        try:
            while (chunk := await updates.get()) is not None:
                yield f"data: {json.dumps(chunk)}\n\n"
            try:
                final = _format(seq.future.result(), item.return_logprob)
            except Exception as e:
                final = {"error": {"message": str(e)}}
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not seq.future.done():
                core.abort(seq.rid)

    return StreamingResponse(events(), media_type="text/event-stream")


# ------------------------------------------------------------------------------------------------
# the app
# ------------------------------------------------------------------------------------------------


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over a started engine loop."""
    app = FastAPI(title="asyncrl embedded rollout engine", version=_version())
    core = state.core

    @app.post("/generate")
    async def generate(request: Request):
        try:
            body = await request.json()
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            return _error(400, f"body is not valid JSON ({e}); send a JSON object")
        try:
            req = _parse_generate(body, state)
        except ValueError as e:
            return _error(400, str(e))
        except (TypeError, KeyError, IndexError, AttributeError) as e:  # a shape not foreseen
            return _error(400, f"malformed /generate body ({type(e).__name__}: {e}); see the "
                               "SGLang /generate fields")
        seqs = _sequences(req, state)
        items, batched = req.items, req.batched
        if req.stream:
            response = _stream(seqs[0], items[0], core)
            core.submit(seqs)
            return response
        core.submit(seqs)
        try:
            outs = await _wait_all(request, seqs, core)
        except RuntimeError as e:
            return _error(500, str(e))
        if outs is None:
            return Response(status_code=499)
        n_per = [it.params.n for it in items]
        lp_flags = [it.return_logprob for it, n in zip(items, n_per, strict=True)
                    for _ in range(n)]
        results = [_format(o, lp) for o, lp in zip(outs, lp_flags, strict=True)]
        if not batched and n_per[0] == 1:
            return JSONResponse(results[0])
        return JSONResponse(results)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _json_or_empty(request)
        path = body.get("model_path")
        if not path:
            return JSONResponse({"success": False, "message": "model_path is required"}, 400)
        async with state.update_lock:
            try:
                model, _, ckpt_version = await asyncio.get_running_loop().run_in_executor(
                    None, load_for_serving, path, core.precision)
                new_version = (int(body["weight_version"])
                               if body.get("weight_version") is not None else ckpt_version)
                await asyncio.wrap_future(core.swap_weights(
                    model, new_version, bool(body.get("abort_all_requests", False))))
            except (CheckpointError, ValueError, TypeError) as e:
                return JSONResponse({"success": False, "message": (
                    f"failed to load weights from {path}: {e}; still serving weight_version "
                    f"{core.weight_version} from {state.model_path}")}, status_code=400)
            state.model_path = str(Path(path).resolve())
        return {"success": True, "message": f"loaded {state.model_path} as weight_version "
                                            f"{core.weight_version}", "num_paused_requests": 0}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await _json_or_empty(request)
        try:
            args = (str(body["master_address"]), int(body["master_port"]),
                    int(body["rank_offset"]), int(body["world_size"]))
            name, backend = str(body.get("group_name", "")), str(body.get("backend", "gloo"))
        except (KeyError, TypeError, ValueError) as e:
            return JSONResponse({"success": False, "message": (
                f"malformed body ({type(e).__name__}: {e}); send master_address, master_port, "
                "rank_offset, world_size, group_name, backend")}, 400)
        if backend != "gloo":
            return JSONResponse({"success": False, "message": (
                f"backend {backend!r}: the embedded server runs on CPU; use backend gloo")}, 400)
        from training.engines.sglang.nccl_sync import new_weight_group

        try:
            group = await asyncio.get_running_loop().run_in_executor(
                None, lambda: new_weight_group(*args, group_name=name, backend=backend,
                                               timeout_s=120.0))
        except Exception as e:  # rendezvous timeout, refused connection
            return JSONResponse({"success": False, "message": (
                f"could not join weight group {name!r} at {args[0]}:{args[1]}: "
                f"{type(e).__name__}: {e}")}, 500)
        state.weight_groups[name] = group
        return {"success": True, "message": f"joined weight group {name!r} as rank {args[2]}"}

    @app.post("/begin_weight_update")
    async def begin_weight_update():
        if state.weight_session:
            return JSONResponse({"success": False, "message": (
                "a weight-update session is already open; call /end_weight_update first")}, 400)
        state.weight_session = True
        return {"success": True, "message": "weight-update session open"}

    @app.post("/end_weight_update")
    async def end_weight_update():
        if not state.weight_session:
            return JSONResponse({"success": False, "message": (
                "no weight-update session is open; call /begin_weight_update first")}, 400)
        state.weight_session = False
        return {"success": True, "message": "weight-update session closed"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await _json_or_empty(request)
        if not state.weight_session:  # as SGLang (0.5.23): only inside a session
            return JSONResponse({"success": False, "message": (
                "update_weights_from_distributed must run between /begin_weight_update and "
                "/end_weight_update")}, 400)
        name = str(body.get("group_name", ""))
        group = state.weight_groups.get(name)
        if group is None:
            return JSONResponse({"success": False, "message": (
                f"no weight group {name!r}; call /init_weights_update_group first")}, 400)
        try:
            names = [str(n) for n in body["names"]]
            dtypes = [getattr(torch, str(d)) for d in body["dtypes"]]
            shapes = [[int(x) for x in shp] for shp in body["shapes"]]
            if not len(names) == len(dtypes) == len(shapes) or not all(
                    isinstance(d, torch.dtype) for d in dtypes):
                raise ValueError("names, dtypes and shapes must be lists of the same length")
            version = body.get("weight_version")
            version = None if version is None else int(version)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            return JSONResponse({"success": False, "message": (
                f"malformed body ({type(e).__name__}: {e})")}, 400)
        async with state.update_lock:
            def receive() -> list[torch.Tensor]:
                import torch.distributed as dist

                tensors = [torch.empty(shp, dtype=d) for shp, d in zip(shapes, dtypes,
                                                                       strict=True)]
                for t in tensors:  # the sender broadcasts in list order
                    dist.broadcast(t, src=0, group=group)
                return tensors

            loop = asyncio.get_running_loop()
            try:
                tensors = await loop.run_in_executor(None, receive)
                model = await loop.run_in_executor(
                    None, _with_weights, core.model, dict(zip(names, tensors, strict=True)),
                    core.precision)
                await asyncio.wrap_future(core.swap_weights(
                    model, core.weight_version if version is None else version))
            except (RuntimeError, ValueError, KeyError) as e:
                return JSONResponse({"success": False, "message": (
                    f"weight update over group {name!r} failed: {e}; still serving "
                    f"weight_version {core.weight_version}")}, 400)
            state.model_path = f"(broadcast over {name})"
        return {"success": True, "message": f"loaded {len(names)} tensors as weight_version "
                                            f"{core.weight_version}"}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await _json_or_empty(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(400, f"mode {mode!r} is not one of {list(PAUSE_MODES)}")
        count = await asyncio.wrap_future(core.pause(mode))
        return {"success": True, "message": f"paused ({mode}); {count} running requests affected"}

    @app.post("/continue_generation")
    async def continue_generation():
        await asyncio.wrap_future(core.resume())
        return {"success": True, "message": "generation continued"}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _json_or_empty(request)
        if body.get("abort_all"):
            count = await asyncio.wrap_future(core.abort(None))
        elif body.get("rid"):
            count = await asyncio.wrap_future(core.abort(str(body["rid"])))
        else:
            return _error(400, "pass rid or abort_all: true")
        return {"success": True, "aborted": count}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return {"success": True, "message": "no prefix cache to flush"}

    @app.get("/health")
    async def health():
        if not core.alive:
            return _error(503, "engine loop is not running")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if not core.alive:
            return _error(503, "engine loop is not running")
        if core.paused is not None:
            return Response(status_code=200)
        seq = Sequence(rid=f"health-{uuid.uuid4().hex}", group_rid="health",
                       prompt_ids=[core.config.bos_token_id],
                       params=SamplingParams(max_new_tokens=1, temperature=0.0),
                       max_new_tokens=1, rng=SequenceRandom(0))
        core.submit([seq])
        try:
            await asyncio.wait_for(asyncio.wrap_future(seq.future), timeout=30.0)
        except (TimeoutError, RuntimeError) as e:
            return _error(503, f"generation health check failed: {e!r}")
        return Response(status_code=200)

    def model_info() -> dict[str, Any]:
        c = core.config
        hf = c.to_hf_dict()
        return {"model_path": state.model_path, "tokenizer_path": state.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": core.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": hf["model_type"],
                "architectures": hf["architectures"], "vocab_size": c.vocab_size,
                "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size,
                "num_local_experts": c.num_experts, "num_experts_per_tok":
                    c.num_experts_per_tok if c.is_moe else None,
                "max_position_embeddings": c.max_position_embeddings,
                "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
                "pad_token_id": c.pad_token_id, "dtype": state.cfg.dtype}

    app.get("/model_info")(model_info)
    app.get("/get_model_info")(model_info)

    def server_info() -> dict[str, Any]:
        cfg = state.cfg
        return {"engine": "asyncrl-embedded", "version": _version(),
                "model_path": state.model_path, "served_model_name": state.name,
                "host": cfg.host, "port": cfg.port, "dtype": cfg.dtype,
                "logit_noise": cfg.logit_noise, "random_seed": cfg.seed,
                "max_running_requests": cfg.max_batch, "threads": cfg.threads,
                "context_length": core.config.max_position_embeddings,
                "max_total_num_tokens": cfg.max_batch * core.config.max_position_embeddings,
                "weight_version": core.weight_version, "uptime_s": time.time() - state.started,
                "internal_states": [core.state()]}

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{
            "id": state.name, "object": "model", "created": int(state.started),
            "owned_by": "asyncrl", "root": state.model_path,
            "max_model_len": core.config.max_position_embeddings}]}

    @app.get("/get_load")
    async def get_load():
        return [{"dp_rank": 0, "num_tokens": core.load_tokens(),
                 "num_reqs": core.state()["running"] + core.state()["waiting"]}]

    return app


def _with_weights(model: CausalLM, weights: dict[str, torch.Tensor],
                  precision: PrecisionConfig) -> CausalLM:
    """A copy of the served ``model`` with ``weights`` (HF names, any dtype) loaded as a
    checkpoint's would be: in fp32, then put into the server precision."""
    import copy

    new = copy.deepcopy(model).float()
    params = new.state_dict()  # shares storage with the parameters (a tied head included)
    with torch.no_grad():
        for name, t in weights.items():
            if name not in params:
                raise KeyError(f"{name!r} is not a weight of the served model")
            if tuple(params[name].shape) != tuple(t.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != the served model's "
                                 f"{tuple(params[name].shape)}")
            params[name].copy_(t.to(torch.float32))
    return apply_precision(new, precision)


async def _json_or_empty(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


# ------------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------------


def build_state(cfg: ServerConfig) -> ServerState:
    """Load the checkpoint (CheckpointError on a bad one) and start the engine loop."""
    torch.set_num_threads(cfg.threads)
    model, tokenizer, weight_version = load_for_serving(cfg.checkpoint, cfg.precision)
    core = RolloutEngineCore(model, tokenizer, cfg.precision, weight_version=weight_version,
                             max_batch=cfg.max_batch).start()
    return ServerState(cfg, core)


class ServerStartError(RuntimeError):
    """The server could not start listening (port in use, bad host); the message names the fix."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (SO_REUSEADDR, as uvicorn sets it; uvicorn listens on it).

    Raises ServerStartError naming the host/port and the fix: port in use, no permission, host
    not an address of this machine or not resolvable.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise ServerStartError(f"--host {host!r} is not an IP address or resolvable name "
                               f"({reason}); pass e.g. --host 127.0.0.1 (local only) or "
                               "0.0.0.0 (all interfaces)") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, like most clients
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ServerStartError(_bind_error(host, port, e)) from None
    return sock


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return (f"port {port} is in use on {host}; pick another --port (or stop the process "
                "listening there)")
    if e.errno == errno.EACCES:
        return (f"no permission to bind port {port} on {host} (ports below 1024 need root); "
                "pick another --port")
    if e.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host} is not an address of this machine; pass --host 127.0.0.1 "
                "(local only) or 0.0.0.0 (all interfaces)")
    return f"cannot listen on {host}:{port} ({e.strerror or e}); check --host and --port"


class _Server(uvicorn.Server):
    """uvicorn's server, calling ``on_started`` once it is listening."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._on_started()


def serve(cfg: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM.

    Raises CheckpointError on a bad checkpoint and ServerStartError when host:port cannot be
    bound, both before anything is served; prints the "serving … on …" line to stderr only once
    the server is listening.
    """
    state = build_state(cfg)
    try:
        sock = bind_socket(cfg.host, cfg.port)
    except ServerStartError:
        state.core.stop()
        raise
    host, port = sock.getsockname()[:2]  # the real port when --port 0
    state.cfg = replace(cfg, port=port)
    shown = f"[{host}]" if ":" in host else host

    def announce() -> None:
        print(f"asyncrl engine: serving {state.model_path} (weight_version "
              f"{state.core.weight_version}, {cfg.dtype}, noise {cfg.logit_noise}) on "
              f"http://{shown}:{port}", file=sys.stderr, flush=True)

    server = _Server(uvicorn.Config(create_app(state), host=cfg.host, port=port,
                                    log_level=cfg.log_level, access_log=False,
                                    timeout_graceful_shutdown=2), announce)
    try:
        server.run(sockets=[sock])
    except SystemExit as e:  # uvicorn exits the process when its startup fails
        if server.started:
            raise
        raise ServerStartError(f"the HTTP server on {cfg.host}:{port} failed to start (uvicorn "
                               f"exit code {e.code}); see the log above") from None
    finally:
        sock.close()
        state.core.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="HF-format checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp8"])
    parser.add_argument("--logit-noise", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (a driver that started the server "
                             "and was killed without stopping it)")


def watch_parent(pid: int, interval_s: float = 1.0) -> None:
    """Send ourselves SIGTERM (a clean uvicorn shutdown) once process ``pid`` no longer exists:
    a server started by a run that was ``kill -9``-ed does not outlive it."""
    import os
    import signal
    import threading

    def loop() -> None:
        while True:
            time.sleep(interval_s)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            except PermissionError:  # exists, owned by someone else
                continue

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="asyncrl embedded rollout server")
    add_arguments(parser)
    a = parser.parse_args(argv)
    if a.parent_pid:
        watch_parent(a.parent_pid)
    try:
        cfg = ServerConfig(checkpoint=a.checkpoint, host=a.host, port=a.port, dtype=a.dtype,
                           logit_noise=a.logit_noise, seed=a.seed, max_batch=a.max_batch,
                           threads=a.threads, served_model_name=a.served_model_name,
                           log_level=a.log_level)
        serve(cfg)
    except (CheckpointError, ServerStartError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
