"""The embedded rollout server: SGLang's HTTP API (the subset RL uses) over the CPU engine loop.

Run it with ``asyncrl engine serve --checkpoint DIR --port P`` (or ``python -m
training.engines.embedded.server``); the options are :class:`ServerConfig`'s fields, one
``--kebab-case`` option each. The routes are grouped by concern (generation, weights, control,
info), each handler receiving its body already validated. Endpoints, with SGLang 0.5.23's field
names and JSON types (``sglang.srt.managers.io_struct``), so a client written against SGLang works
unchanged:

- ``POST /generate`` (``GenerateReqInput``): ``input_ids`` (or ``text``; a list of either is a
  batch), ``sampling_params`` (one object or one per batch item), ``return_logprob`` (bool or one
  per item), ``logprob_start_len`` (int or one per item), ``return_text_in_logprobs``,
  ``return_routed_experts``, ``routed_experts_start_len`` (in [0, prompt length]), ``rid`` (a
  string; for a batch a prefix — item i is ``rid_i`` — or one distinct string per item),
  ``stream`` (SSE, single request with n = 1). Answers ``{text, output_ids, meta_info}``; a batch
  and/or n > 1 answers a list, request-major (item i's samples at i·n … i·n + n − 1).
  ``meta_info``: ``id``, ``finish_reason``, ``prompt_tokens``, ``completion_tokens``,
  ``weight_version`` (the label of the weights that produced the last token, as SGLang),
  ``output_token_weight_versions`` (one label per output token), ``output_token_logprobs``
  ([logprob, token_id, token text or null] per token), ``routed_experts`` (base64 int32,
  (P + O − 1 − start, L, k): every position whose next token was computed; (0, L, k) for a
  request aborted while still queued), ``e2e_latency``. A ``text`` prompt is tokenised with
  <bos> prepended. The whole body is validated before anything is queued.
- ``POST /update_weights_from_disk`` {model_path, weight_version?, abort_all_requests?,
  load_format?, …} → {success, message, num_paused_requests}; a bad path keeps the old weights
  (HTTP 400, success false).
- ``POST /init_weights_update_group`` {master_address, master_port, rank_offset, world_size,
  group_name, backend} → {success, message}: join a weight-broadcast group as rank
  ``rank_offset`` (gloo only: the server is CPU-only); ``POST /update_weights_from_distributed``
  {names, dtypes, shapes, group_name, weight_version?, abort_all_requests?, …}: receive those
  tensors by broadcast from rank 0 in list order and serve them (HF names; loaded as a
  checkpoint's would be, in the server precision) (:mod:`training.engines.sglang.nccl_sync` is
  the sender); as in SGLang 0.5.23 only inside a session opened by ``POST /begin_weight_update``
  and closed by ``POST /end_weight_update``.
- ``POST /update_weight_version`` {new_version, abort_all_requests} and ``GET
  /get_weight_version``: relabel / read the served weights' version.
- ``POST /pause_generation`` {mode: abort | retract | in_place}, ``POST /continue_generation``,
  ``POST /abort_request`` {rid | abort_all}, ``GET|POST /flush_cache`` (no prefix cache: no-op).
- ``GET /health``, ``GET /health_generate`` (a one-token generation), ``GET /model_info``
  (= ``/get_model_info``), ``GET /server_info`` (= ``/get_server_info``; engine counters under
  ``internal_states``), ``GET /v1/models``, ``GET /get_load``.

Weight versions are SGLang's opaque strings both ways (``"default"`` when the checkpoint names
none; an asyncrl checkpoint names its ``asyncrl.json`` version, ``"7"``); the engine orders them
by load (see :mod:`.engine`). A body is read with SGLang's types and JSON's own values only (a
string is not a number or a boolean): a body that is not a JSON object (on every endpoint that
reads one), a field of the wrong type, a missing required field, or a feature this engine does
not implement asked for (top log-probs, hidden states, LoRA, images, penalties, grammars…)
answers HTTP 400 with one line naming the field and the fix, in SGLang's
error shape (``{"object": "error", "message", "type", "code"}``, plus ``error.message`` and, for
the weight endpoints, ``success: false``). SGLang fields that change nothing on one CPU engine
(routing, logging, priority, disaggregation, CUDA-graph and cache knobs) and unknown fields are
ignored, as SGLang ignores unknown fields — so bodies rewritten by ``sglang-router`` and sent by
``sglang.bench_serving`` work as they are.

Departures from SGLang: an update applies between decode steps even to running requests (their
later tokens carry the new version), without waiting for them to finish; input-token log-probs
(``logprob_start_len`` ≥ 0 with ``return_logprob``) are not returned; a disk load that names no
``weight_version`` reports the checkpoint's own (``asyncrl.json``) when it has one; strings such as
``"true"`` or ``"7"`` are not read as booleans or numbers (SGLang's pydantic coerces them).
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
from dataclasses import dataclass
from http import HTTPStatus
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, NoReturn, Union, get_args, get_origin

import torch
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.engines.embedded.engine import RolloutEngineCore, Sequence, SequenceOutput
from training.engines.hf_io import META_FILE, CheckpointError, load_hf_dir
from training.engines.model import CausalLM
from training.engines.rollout import (
    SamplingParams,
    brief_repr,
    encode_routed_experts,
    weight_version_label,
)
from training.engines.sampling import PrecisionConfig, SequenceRandom, apply_precision
from training.tasks.tokenizer import CharTokenizer


class ServerConfigError(ValueError):
    """A server option out of its range or choices; the message is one line naming the
    ``--option`` and the values it takes."""


class ServerConfig(BaseModel):
    """Options of ``asyncrl engine serve`` (= ``python -m training.engines.embedded.server``).

    The one definition of the options: each field is the ``--kebab-case`` option of the same
    name, with its type, default, bounds and (as the description) its help (:func:`add_arguments`
    builds the parser from the fields, :meth:`argv` the command line back). An invalid option
    raises ServerConfigError in one line.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint: str = Field(description="HF-format checkpoint directory to serve (config.json + "
                                        "model.safetensors + tokenizer).")
    host: str = Field("127.0.0.1", description="Interface to bind (no authentication: keep it "
                                               "local unless the network is trusted).")
    port: int = Field(30000, ge=0, le=65535, description="Port to listen on (0: a free one).")
    dtype: Literal["bf16", "fp32", "fp8"] = Field(
        "bf16", description="Engine numerics (fp8: simulated fp8 weights, bf16 compute).")
    logit_noise: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                               description="Std of Gaussian noise added to the logits.")
    seed: int = Field(0, description="Engine seed (logit noise, requests that bring no seed).")
    max_batch: int = Field(64, ge=1, description="Most sequences decoded together.")
    threads: int = Field(1, ge=1, description="torch intra-op threads of the server process (1 "
                                              "keeps several servers and a trainer off each "
                                              "other's cores).")
    served_model_name: str | None = Field(
        None, description="Name reported by /v1/models (default: the checkpoint directory name).")
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "warning", description="uvicorn's log level.")
    weight_version: str | None = Field(
        None, description="Version label of the served weights, as SGLang's --weight-version "
                          "(default: the checkpoint's asyncrl.json version, else 'default').")

    def __init__(self, **options: Any) -> None:
        try:
            super().__init__(**options)
        except ValidationError as e:
            raise ServerConfigError(_option_error(e)) from None

    @property
    def precision(self) -> PrecisionConfig:
        return PrecisionConfig(dtype=self.dtype, logit_noise=self.logit_noise, seed=self.seed)

    def argv(self) -> list[str]:
        """The command-line options that give this config back (unset optional ones left out)."""
        return [arg for name, value in self if value is not None
                for arg in (_option(name), str(value))]


def _option(field: str) -> str:
    """The command-line option of a ServerConfig field: max_batch → --max-batch."""
    return "--" + field.replace("_", "-")


def _option_error(e: ValidationError) -> str:
    """The first error of a ServerConfig validation as one line naming the option."""
    errors = e.errors(include_url=False)
    first = errors[0]
    name = str(first["loc"][0]) if first["loc"] else "options"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if first["type"] == "missing":
        return f"{_option(name)} is required{more}"
    if first["type"] == "extra_forbidden":
        return (f"{name} is not a server option{more}; the options are "
                f"{', '.join(ServerConfig.model_fields)}")
    reason = first["msg"][0].lower() + first["msg"][1:]
    return f"{_option(name)} {first['input']!r}: {reason}{more}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per ServerConfig field (name → ``--kebab-case``; its type, default, help and,
    for a Literal, its choices), and ``--parent-pid``."""
    for name, field in ServerConfig.model_fields.items():
        kind = field.annotation
        if get_origin(kind) in (Union, UnionType):  # X | None: the option's type is X
            [kind] = [a for a in get_args(kind) if a is not type(None)]
        choices = get_args(kind) if get_origin(kind) is Literal else None
        parser.add_argument(_option(name), dest=name, required=field.is_required(),
                            default=None if field.is_required() else field.default,
                            type=type(choices[0]) if choices else kind, choices=choices,
                            help=field.description)
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (a driver that started the server "
                             "and was killed without stopping it)")


def load_for_serving(path: str | Path, precision: PrecisionConfig
                     ) -> tuple[CausalLM, CharTokenizer, str | None]:
    """Load a checkpoint in fp32 and put it into the engine precision (CheckpointError on a bad
    directory) → (model, tokenizer, the version label its ``asyncrl.json`` names, else None)."""
    ckpt = load_hf_dir(path, torch.float32)
    named = (Path(path) / META_FILE).is_file()
    label = weight_version_label(ckpt.weight_version) if named else None
    return apply_precision(ckpt.model, precision), ckpt.tokenizer, label


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


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    """An error answer: SGLang's ``ErrorResponse`` fields (what its validation errors answer),
    ``error.message`` (OpenAI's shape) and ``extra`` (``success: false`` on weight endpoints)."""
    return JSONResponse({**extra, "object": "error", "message": message,
                         "type": HTTPStatus(status).phrase, "param": None, "code": status,
                         "error": {"message": message}}, status_code=status)


# ------------------------------------------------------------------------------------------------
# request bodies: SGLang's io_struct types, strictly
# ------------------------------------------------------------------------------------------------


class _Body(BaseModel):
    """A control endpoint's JSON body with SGLang 0.5.23's field types (``io_struct``): a field
    SGLang has but that changes nothing here is declared (so its type is checked) and ignored;
    unknown fields are ignored, as SGLang ignores them."""

    model_config = ConfigDict(extra="ignore", strict=True)
    rid: str | None = None  # BaseReq


class _UpdateFromDisk(_Body):  # UpdateWeightFromDiskReqInput
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class _InitWeightGroup(_Body):  # InitWeightsUpdateGroupReqInput
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class _UpdateFromDistributed(_Body):  # UpdateWeightsFromDistributedReqInput
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class _WeightSession(_Body):  # Begin/EndWeightUpdateReqInput
    selector: str | None = None


class _UpdateWeightVersion(_Body):  # UpdateWeightVersionReqInput
    new_version: str
    abort_all_requests: bool = True


class _Pause(_Body):  # PauseGenerationReqInput
    mode: Literal["abort", "retract", "in_place"] = "abort"


class _Continue(_Body):  # ContinueGenerationReqInput
    torch_empty_cache: bool = True


class _Abort(_Body):  # AbortReq
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None


class _FlushCache(_Body):  # FlushCacheReqInput
    timeout_s: float | None = None


# load formats that read this server's checkpoints (HF safetensors); SGLang's others (dummy,
# gguf, bitsandbytes, …) do not apply
_LOAD_FORMATS = (None, "auto", "safetensors")


class BodyError(ValueError):
    """A request body that cannot be served (HTTP 400); the message is one line naming the field
    and the fix."""


async def _read_json(request: Request) -> Any:
    """The JSON body (an empty body is ``{}``, as SGLang's optional bodies)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise BodyError(f"body is not valid JSON ({e}); send a JSON object") from None


async def _parse(request: Request, model: type[_Body]) -> Any:
    """The body as ``model``; BodyError naming the first bad field."""
    body = await _read_json(request)
    if not isinstance(body, dict):
        raise BodyError(f"the body must be a JSON object, got {brief_repr(body)}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise BodyError(_validation_message(e, model)) from None


def _validation_message(e: ValidationError, model: type[_Body]) -> str:
    errors = e.errors(include_url=False)
    first = errors[0]
    field = ".".join(str(p) for p in first["loc"]) or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if first["type"] == "missing":
        required = [n for n, f in model.model_fields.items() if f.is_required()]
        return f"{field} is required{more}; send {', '.join(required)}"
    value = first.get("input")
    message = f"{field}: {first['msg'][0].lower()}{first['msg'][1:]}, got {brief_repr(value)}{more}"
    if first["type"] == "string_type" and isinstance(value, int | float) \
            and not isinstance(value, bool):
        message += f' (SGLang\'s type is a string: send "{value}")'
    return message


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
    text_in_logprobs: bool


_INPUT_IDS_SHAPE = "a list of token ids such as [1, 5, 6], or a list of such lists for a batch"

# GenerateReqInput fields asking for what this engine does not compute: accepted at the value that
# leaves them off (what SGLang's own clients send by default), refused otherwise, so an answer never
# silently lacks what was asked for. name → what to do instead.
_UNSUPPORTED_GENERATE_FIELDS: dict[str, str] = {
    "input_embeds": "send input_ids or text",
    "image_data": "the served model reads text only",
    "video_data": "the served model reads text only",
    "audio_data": "the served model reads text only",
    "lora_path": "the server has no LoRA adapters",
    "lora_id": "the server has no LoRA adapters",
    "session_params": "the server keeps no sessions",
    "custom_logit_processor": "the server runs no custom logit processors",
    "positional_embed_overrides": "send input_ids or text",
    "top_logprobs_num": "only the sampled tokens' log-probs are returned "
                        "(output_token_logprobs)",
    "token_ids_logprob": "only the sampled tokens' log-probs are returned "
                         "(output_token_logprobs)",
    "return_hidden_states": "hidden states are not returned",
    "return_entropy": "entropies are not returned",
    "return_sampling_mask": "sampling masks are not returned",
    "return_prompt_token_ids": "the prompt is what was sent (text: <bos> + its characters)",
    "return_flat_raw_top_logprobs": "top log-probs are not returned",
    "return_flat_raw_top_logprobs_b64": "top log-probs are not returned",
    "return_indexer_topk": "indexer top-k is not returned",
    "return_bytes": "the engine generates text",
    "require_reasoning": "the served model has no reasoning mode",
    "max_thinking_tokens": "the served model has no reasoning mode",
    "multi_item_delimiter_indices": "multi-item scoring is not served",
}
# Every other GenerateReqInput field changes nothing on one CPU engine and is ignored: routing
# (routed_dp_rank, data_parallel_rank, routing_key, kv_router_hint, bootstrap_*,
# disagg_prefill_dp_rank, decode_tp_size), bookkeeping (log_metrics, no_logs, custom_labels,
# conversation_id, session_id, priority, extra_key, cache_salt, background,
# external_trace_header, received_time, http_worker_ipc), multimodal detail and the ``model`` the
# router adds.


def _is_off(value: Any) -> bool:
    """A field left at a value that asks for nothing (per batch item when a list)."""
    if isinstance(value, list):
        return all(_is_off(v) for v in value)
    return value is None or value is False or value == "" or value == {} or (
        isinstance(value, int) and value == 0)


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise BodyError(f"{name} has {len(value)} entries for a batch of {count} prompts; "
                            "send one value, or one per prompt")
        return value
    return [value] * count


def _flag(value: Any, name: str) -> bool:
    """A JSON boolean field (null = false)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BodyError(f"{name} must be true or false, got {brief_repr(value)}")
    return value


def _prompts(body: dict[str, Any], state: ServerState) -> tuple[list[list[int]], bool]:
    """→ (token-id prompts, batched) from ``input_ids`` or ``text``."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise BodyError("pass exactly one of input_ids or text")
    if has_text:
        raw = body["text"]
        if isinstance(raw, str):
            return [state.tokenizer.encode(raw, add_bos=True)], False
        if not (isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw)):
            raise BodyError(f"text must be a string or a non-empty list of strings, got "
                            f"{brief_repr(raw)}")
        return [state.tokenizer.encode(t, add_bos=True) for t in raw], True
    raw = body["input_ids"]
    if not isinstance(raw, list):
        raise BodyError(f"input_ids must be {_INPUT_IDS_SHAPE}; got {brief_repr(raw)}")
    batched = bool(raw) and isinstance(raw[0], list)
    prompts = raw if batched else [raw]
    vocab = state.core.config.vocab_size
    for i, prompt in enumerate(prompts):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not isinstance(prompt, list) or not prompt:
            raise BodyError(f"{where} must be a non-empty list of token ids; input_ids must be "
                            f"{_INPUT_IDS_SHAPE}")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise BodyError(f"{where} holds {brief_repr(t)}: input_ids must be token ids "
                                f"in [0, {vocab}) (the model's vocab_size)")
    return [list(p) for p in prompts], batched


def _rids(value: Any, count: int, batched: bool) -> list[str]:
    """Request ids as SGLang's ``_normalize_rid``: a batch's string is a prefix (item i is
    ``rid_i``), a list names each item (distinct); none: fresh ids."""
    if value is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(value, str):
        return [f"{value}_{i}" for i in range(count)] if batched else [value]
    if batched and isinstance(value, list) and all(isinstance(r, str) for r in value):
        if len(value) != count:
            raise BodyError(f"rid has {len(value)} ids for a batch of {count} prompts; send one "
                            "per prompt, or one string as a prefix")
        if len(set(value)) != count:
            raise BodyError(f"rid holds duplicate ids {brief_repr(value)}; send distinct ones")
        return list(value)
    also = " or a list of one string per prompt" if batched else ""
    raise BodyError(f"rid must be a string{also}, got {brief_repr(value)}")


def _int_field(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BodyError(f"{name} must be an integer, got {brief_repr(value)}")
    return value


def _parse_generate(body: Any, state: ServerState) -> _GenerateBody:
    """Validate a whole ``/generate`` body. Raises BodyError (HTTP 400) naming the field and the
    fix; nothing is queued until every field parsed."""
    cfg = state.core.config
    if not isinstance(body, dict):
        raise BodyError(f'the body must be a JSON object such as {{"input_ids": [1, 5], '
                        f'"sampling_params": {{}}}}, got {brief_repr(body)}')
    for name, instead in _UNSUPPORTED_GENERATE_FIELDS.items():
        if not _is_off(body.get(name)):
            raise BodyError(f"{name}={brief_repr(body[name])} is not supported by this engine "
                            f"({instead}); omit it")
    prompts, batched = _prompts(body, state)
    count = len(prompts)
    sampling = _per_item(body.get("sampling_params"), count, "sampling_params")
    try:
        params = [SamplingParams.from_sglang(p) for p in sampling]
    except ValueError as e:
        raise BodyError(str(e)) from None
    logprob = [_flag(v, "return_logprob")
               for v in _per_item(body.get("return_logprob"), count, "return_logprob")]
    starts = [None if v is None else _int_field(v, "logprob_start_len")
              for v in _per_item(body.get("logprob_start_len"), count, "logprob_start_len")]
    for lp, start in zip(logprob, starts, strict=True):
        if lp and start not in (None, -1):  # SGLang: -1 = output tokens only
            raise BodyError(f"logprob_start_len={start}: input-token log-probs are not returned "
                            "(they come from the trainer); send -1 or omit it")
    rids = _rids(body.get("rid"), count, batched)
    return_routes = _flag(body.get("return_routed_experts"), "return_routed_experts")
    start = body.get("routed_experts_start_len")
    start = 0 if start is None else start
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise BodyError(f"routed_experts_start_len must be an integer >= 0 (the first position "
                        f"whose routes are returned; 0 = all), got {brief_repr(start)}")
    if return_routes and not cfg.is_moe:
        raise BodyError("return_routed_experts: the served model is dense (no experts); omit "
                        "it or serve an MoE checkpoint")
    text_in_logprobs = _flag(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
    stream = _flag(body.get("stream"), "stream")
    if stream and (batched or params[0].n != 1):
        raise BodyError("stream supports one prompt with n = 1; send a batch or n > 1 without "
                        "stream")
    for i, prompt in enumerate(prompts):
        if len(prompt) >= cfg.max_position_embeddings:
            raise BodyError(f"prompt {i} has {len(prompt)} tokens and leaves no room to "
                            f"generate: the context length is {cfg.max_position_embeddings}; "
                            "shorten it")
        if return_routes and start > len(prompt):  # SGLang: in [0, prompt_tokens]
            raise BodyError(f"routed_experts_start_len {start} is past prompt {i} "
                            f"({len(prompt)} tokens); it must be in [0, prompt length]")
    items = [_Item(prompt, p, rid, lp)
             for prompt, p, lp, rid in zip(prompts, params, logprob, rids, strict=True)]
    return _GenerateBody(items, batched, stream, return_routes, start, text_in_logprobs)


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


def _format(out: SequenceOutput, return_logprob: bool, tokenizer: CharTokenizer | None,
            final: bool = True) -> dict[str, Any]:
    """One answer object; ``tokenizer``: decode each output token into its log-prob entry
    (``return_text_in_logprobs``), else null there."""
    meta: dict[str, Any] = {
        "id": out.rid, "finish_reason": out.finish if final else None,
        "prompt_tokens": len(out.prompt_ids), "completion_tokens": len(out.output_ids),
        "cached_tokens": 0, "weight_version": out.weight_version,
        "output_token_weight_versions": out.token_versions,
        "e2e_latency": out.finished - out.created,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, None if tokenizer is None else tokenizer.decode([t],
                                                                    skip_special_tokens=False)]
            for lp, t in zip(out.logprobs, out.output_ids, strict=True)]
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


def _stream(seq: Sequence, item: _Item, core: RolloutEngineCore,
            tokenizer: CharTokenizer | None) -> StreamingResponse:
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def on_step(s: Sequence) -> None:  # engine thread: snapshot, then hand to the event loop
        snap = _format(core.snapshot(s, {}), item.return_logprob, tokenizer, final=False)
        loop.call_soon_threadsafe(updates.put_nowait, snap)

    seq.on_step = on_step
    seq.future.add_done_callback(lambda _: loop.call_soon_threadsafe(updates.put_nowait, None))

    async def events():
        try:
            while (chunk := await updates.get()) is not None:
                yield f"data: {json.dumps(chunk)}\n\n"
            try:
                final = _format(seq.future.result(), item.return_logprob, tokenizer)
            except Exception as e:
                final = {"error": {"message": str(e)}}
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not seq.future.done():
                core.abort(seq.rid)

    return StreamingResponse(events(), media_type="text/event-stream")


# ------------------------------------------------------------------------------------------------
# the app: one router per concern; handlers receive the shared state and their typed body
# ------------------------------------------------------------------------------------------------


def _server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(_server_state)]


def _body(model: type[_Body]) -> Any:
    """A dependency giving the request body as ``model`` (BodyError naming the field)."""

    async def parse(request: Request) -> _Body:
        return await _parse(request, model)

    return Depends(parse)


async def _generate_body(request: Request, state: State) -> _GenerateBody:
    try:
        return _parse_generate(await _read_json(request), state)
    except BodyError:
        raise
    except ValueError as e:  # e.g. a text character the tokenizer does not know
        raise BodyError(str(e)) from None
    except (TypeError, KeyError, IndexError, AttributeError) as e:  # a shape not foreseen
        raise BodyError(f"malformed /generate body ({type(e).__name__}: {e}); see SGLang's "
                        "GenerateReqInput fields") from None


generation_routes = APIRouter(tags=["generation"])


@generation_routes.post("/generate")
@generation_routes.put("/generate")
async def generate(request: Request, state: State,
                   req: Annotated[_GenerateBody, Depends(_generate_body)]) -> Response:
    core = state.core
    seqs = _sequences(req, state)
    tokenizer = state.tokenizer if req.text_in_logprobs else None
    if req.stream:
        response = _stream(seqs[0], req.items[0], core, tokenizer)
        core.submit(seqs)
        return response
    core.submit(seqs)
    try:
        outs = await _wait_all(request, seqs, core)
    except RuntimeError as e:
        return _error(500, str(e))
    if outs is None:
        return Response(status_code=499)
    return JSONResponse(_answer(req, outs, tokenizer))


def _answer(req: _GenerateBody, outs: list[SequenceOutput], tokenizer: CharTokenizer | None
            ) -> dict[str, Any] | list[dict[str, Any]]:
    """One object for a single request with n = 1, else the request-major list."""
    flags = [it.return_logprob for it in req.items for _ in range(it.params.n)]
    results = [_format(o, lp, tokenizer) for o, lp in zip(outs, flags, strict=True)]
    if not req.batched and req.items[0].params.n == 1:
        return results[0]
    return results


weight_routes = APIRouter(tags=["weights"])


@weight_routes.post("/update_weights_from_disk")
async def update_weights_from_disk(state: State,
                                   body: Annotated[_UpdateFromDisk, _body(_UpdateFromDisk)]):
    core, path = state.core, body.model_path
    if not path:
        raise BodyError("model_path is required: the checkpoint directory to load")
    if body.load_format not in _LOAD_FORMATS:
        raise BodyError(f"load_format {body.load_format!r}: this server loads HF safetensors "
                        "checkpoints; send auto or omit it")
    if body.keep_pause:  # SGLang pauses for a load and can stay paused; a load here never
        raise BodyError("keep_pause: a weight load here never pauses generation; omit it "
                        "and call /pause_generation")
    async with state.update_lock:
        try:
            model, _, ckpt_label = await asyncio.get_running_loop().run_in_executor(
                None, load_for_serving, path, core.precision)
            await asyncio.wrap_future(core.swap_weights(
                model, body.weight_version or ckpt_label, body.abort_all_requests))
        except (CheckpointError, ValueError) as e:
            return JSONResponse({"success": False, "message": (
                f"failed to load weights from {path}: {e}; still serving weight_version "
                f"{core.weight_version} from {state.model_path}"),
                "num_paused_requests": 0}, status_code=400)
        state.model_path = str(Path(path).resolve())
    return {"success": True, "message": f"loaded {state.model_path} as weight_version "
                                        f"{core.weight_version}", "num_paused_requests": 0}


@weight_routes.post("/init_weights_update_group")
async def init_weights_update_group(state: State,
                                    body: Annotated[_InitWeightGroup, _body(_InitWeightGroup)]):
    if body.backend != "gloo":
        raise BodyError(f"backend {body.backend!r}: the embedded server runs on CPU; use "
                        "backend gloo")
    from training.engines.sglang.nccl_sync import new_weight_group

    name = body.group_name
    try:
        group = await asyncio.get_running_loop().run_in_executor(
            None, lambda: new_weight_group(
                body.master_address, body.master_port, body.rank_offset, body.world_size,
                group_name=name, backend=body.backend, timeout_s=120.0))
    except Exception as e:  # rendezvous timeout, refused connection
        return JSONResponse({"success": False, "message": (
            f"could not join weight group {name!r} at {body.master_address}:"
            f"{body.master_port}: {type(e).__name__}: {e}")}, 500)
    state.weight_groups[name] = group
    return {"success": True, "message": f"joined weight group {name!r} as rank {body.rank_offset}"}


@weight_routes.post("/begin_weight_update")
async def begin_weight_update(state: State,
                              body: Annotated[_WeightSession, _body(_WeightSession)]):
    _only_target(body)
    if state.weight_session:
        return JSONResponse({"success": False, "message": (
            "a weight-update session is already open; call /end_weight_update first")}, 400)
    state.weight_session = True
    return {"success": True, "message": "weight-update session open"}


@weight_routes.post("/end_weight_update")
async def end_weight_update(state: State,
                            body: Annotated[_WeightSession, _body(_WeightSession)]):
    _only_target(body)
    if not state.weight_session:
        return JSONResponse({"success": False, "message": (
            "no weight-update session is open; call /begin_weight_update first")}, 400)
    state.weight_session = False
    return {"success": True, "message": "weight-update session closed"}


@weight_routes.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
        state: State, body: Annotated[_UpdateFromDistributed, _body(_UpdateFromDistributed)]):
    core, name = state.core, body.group_name
    if not state.weight_session:  # as SGLang (0.5.23): only inside a session
        return JSONResponse({"success": False, "message": (
            "update_weights_from_distributed must run between /begin_weight_update and "
            "/end_weight_update")}, 400)
    group = state.weight_groups.get(name)
    if group is None:
        return JSONResponse({"success": False, "message": (
            f"no weight group {name!r}; call /init_weights_update_group first")}, 400)
    dtypes = _tensor_dtypes(body)
    async with state.update_lock:
        loop = asyncio.get_running_loop()
        try:
            tensors = await loop.run_in_executor(None, _receive, body.shapes, dtypes, group)
            model = await loop.run_in_executor(
                None, _with_weights, core.model, dict(zip(body.names, tensors, strict=True)),
                core.precision)
            await asyncio.wrap_future(core.swap_weights(
                model, body.weight_version, body.abort_all_requests))
        except (RuntimeError, ValueError, KeyError) as e:
            return JSONResponse({"success": False, "message": (
                f"weight update over group {name!r} failed: {e}; still serving "
                f"weight_version {core.weight_version}")}, 400)
        state.model_path = f"(broadcast over {name})"
    return {"success": True, "message": f"loaded {len(body.names)} tensors as weight_version "
                                        f"{core.weight_version}"}


@weight_routes.post("/update_weight_version")
async def update_weight_version(
        state: State, body: Annotated[_UpdateWeightVersion, _body(_UpdateWeightVersion)]):
    async with state.update_lock:  # the same weights, as a new load under the new label
        await asyncio.wrap_future(state.core.swap_weights(None, body.new_version,
                                                          body.abort_all_requests))
    return {"success": True, "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version}


# endpoints whose SGLang answers carry `success` (also on a refusal here)
_WEIGHT_PATHS = frozenset(route.path for route in weight_routes.routes)


def _only_target(body: _WeightSession) -> None:
    if body.selector not in (None, "all", "target"):  # SGLang: all | target | draft
        raise BodyError(f"selector {body.selector!r}: the embedded server serves one model (no "
                        "draft); send all, target or omit it")


def _tensor_dtypes(body: _UpdateFromDistributed) -> list[torch.dtype]:
    """The torch dtypes ``body`` names, one per tensor (BodyError on a mismatch)."""
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise BodyError("names, dtypes and shapes must be lists of the same length")
    dtypes = [getattr(torch, d, None) for d in body.dtypes]
    for d, dtype in zip(body.dtypes, dtypes, strict=True):
        if not isinstance(dtype, torch.dtype):
            raise BodyError(f"dtypes holds {d!r}, not a torch dtype name such as bfloat16")
    return dtypes


def _receive(shapes: list[list[int]], dtypes: list[torch.dtype], group: Any
             ) -> list[torch.Tensor]:
    """The tensors rank 0 of ``group`` broadcasts, in list order."""
    import torch.distributed as dist

    tensors = [torch.empty(shape, dtype=d) for shape, d in zip(shapes, dtypes, strict=True)]
    for t in tensors:
        dist.broadcast(t, src=0, group=group)
    return tensors


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


control_routes = APIRouter(tags=["control"])


@control_routes.post("/pause_generation")
async def pause_generation(state: State, body: Annotated[_Pause, _body(_Pause)]):
    count = await asyncio.wrap_future(state.core.pause(body.mode))
    return {"success": True, "status": "ok",
            "message": f"paused ({body.mode}); {count} running requests affected"}


@control_routes.post("/continue_generation")
async def continue_generation(state: State, body: Annotated[_Continue, _body(_Continue)]):
    await asyncio.wrap_future(state.core.resume())  # torch_empty_cache: no CUDA cache here
    return {"success": True, "status": "ok", "message": "generation continued"}


@control_routes.post("/abort_request")
async def abort_request(state: State, body: Annotated[_Abort, _body(_Abort)]):
    if body.abort_all:
        count = await asyncio.wrap_future(state.core.abort(None))
    elif body.rid:
        count = await asyncio.wrap_future(state.core.abort(body.rid))
    else:  # SGLang's AbortReq defaults: nothing to abort
        return {"success": True, "aborted": 0,
                "message": "nothing aborted: pass rid or abort_all: true"}
    return {"success": True, "aborted": count}


@control_routes.get("/flush_cache")
@control_routes.post("/flush_cache")
async def flush_cache(body: Annotated[_FlushCache, _body(_FlushCache)]):  # types checked only
    return {"success": True, "message": "no prefix cache to flush"}


info_routes = APIRouter(tags=["info"])


@info_routes.get("/health")
async def health(state: State) -> Response:
    if not state.core.alive:
        return _error(503, "engine loop is not running")
    return Response(status_code=200)


@info_routes.get("/health_generate")
async def health_generate(state: State) -> Response:
    core = state.core
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


@info_routes.get("/get_weight_version")
async def get_weight_version(state: State):
    return {"weight_version": state.core.weight_version}


@info_routes.get("/model_info")
@info_routes.get("/get_model_info")
def model_info(state: State):
    c, hf = state.core.config, state.core.config.to_hf_dict()
    return {"model_path": state.model_path, "tokenizer_path": state.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": state.core.weight_version, "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": hf["model_type"],
            "architectures": hf["architectures"], "vocab_size": c.vocab_size,
            "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size,
            "num_local_experts": c.num_experts, "num_experts_per_tok":
                c.num_experts_per_tok if c.is_moe else None,
            "max_position_embeddings": c.max_position_embeddings,
            "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
            "pad_token_id": c.pad_token_id, "dtype": state.cfg.dtype}


@info_routes.get("/server_info")
@info_routes.get("/get_server_info")
def server_info(state: State):
    cfg, core = state.cfg, state.core
    return {"engine": "asyncrl-embedded", "version": _version(),
            "model_path": state.model_path, "served_model_name": state.name,
            "host": cfg.host, "port": cfg.port, "dtype": cfg.dtype,
            "logit_noise": cfg.logit_noise, "random_seed": cfg.seed,
            "max_running_requests": cfg.max_batch, "threads": cfg.threads,
            "context_length": core.config.max_position_embeddings,
            "max_total_num_tokens": cfg.max_batch * core.config.max_position_embeddings,
            "weight_version": core.weight_version, "uptime_s": time.time() - state.started,
            "internal_states": [core.state()]}


@info_routes.get("/v1/models")
async def list_models(state: State):
    return {"object": "list", "data": [{
        "id": state.name, "object": "model", "created": int(state.started),
        "owned_by": "asyncrl", "root": state.model_path,
        "max_model_len": state.core.config.max_position_embeddings}]}


@info_routes.get("/get_load")
async def get_load(state: State):
    core = state.core
    return [{"dp_rank": 0, "num_tokens": core.load_tokens(),
             "num_reqs": core.state()["running"] + core.state()["waiting"]}]


async def _body_error(request: Request, e: BodyError) -> JSONResponse:
    extra = {"success": False} if request.url.path in _WEIGHT_PATHS else {}
    return _error(400, str(e), **extra)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over a started engine loop."""
    app = FastAPI(title="asyncrl embedded rollout engine", version=_version())
    app.state.server = state
    app.add_exception_handler(BodyError, _body_error)
    for router in (generation_routes, weight_routes, control_routes, info_routes):
        app.include_router(router)
    return app


# ------------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------------


def build_state(cfg: ServerConfig) -> ServerState:
    """Load the checkpoint (CheckpointError on a bad one) and start the engine loop."""
    torch.set_num_threads(cfg.threads)
    model, tokenizer, ckpt_label = load_for_serving(cfg.checkpoint, cfg.precision)
    label = cfg.weight_version or ckpt_label or "default"  # SGLang's label before any load
    core = RolloutEngineCore(model, tokenizer, cfg.precision, weight_version=label,
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
    state.cfg = cfg.model_copy(update={"port": port})
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


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (no usage block), as the CLI's other errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see --help\n")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse the options (``prog``: the command named in --help), validate them and serve; a bad
    option, checkpoint or address is one line on stderr and exit code 1 (argparse's 2 for an
    unknown option, a missing value or a value not among the choices)."""
    parser = _Parser(prog=prog or "python -m training.engines.embedded.server",
                     description="asyncrl embedded rollout server: SGLang's HTTP API over a CPU "
                                 "engine loop",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    options = vars(parser.parse_args(argv))
    parent_pid = options.pop("parent_pid")
    try:
        cfg = ServerConfig(**options)
        if parent_pid:
            watch_parent(parent_pid)
        serve(cfg)
    except (CheckpointError, ServerStartError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
