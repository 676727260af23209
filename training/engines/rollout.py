"""The rollout-engine contract an RL trainer programs against, for every rollout backend.

A rollout engine is an HTTP server speaking the subset of SGLang's API (0.5.x) that RL needs: the
embedded CPU server (``training.engines.embedded``) and SGLang's own ``launch_server`` both fit, so
the trainer, the router and the mismatch check never know which one answers. This module holds the
typed edge of that API and nothing heavy (no torch): the request/result dataclasses, their
conversion to and from SGLang's JSON, the routed-experts codec, and the :class:`RolloutEngine`
protocol that ``training.engines.client.RolloutClient`` implements for one or many engine URLs.

Conventions (shared with the train engine):

- A prompt is a list of token ids starting with ``<bos>``; a response ends with the stop token or
  is cut at ``max_new_tokens`` (``finish_reason`` "length").
- ``output_logprobs[i]`` is the log-probability of ``output_ids[i]`` under the distribution the
  engine actually sampled from: softmax(logits / temperature), restricted to the top-k / top-p
  set and renormalised over it (see ``training.engines.sampling``). Greedy requests
  (temperature 0) report log_softmax(logits) at temperature 1, untruncated.
- Routed experts (MoE): an int32 array (P + O − 1 − start, num_layers, top_k): the experts chosen
  at every position whose next token the model computed, on the wire as ONE base64 string of the
  row-major bytes (``meta_info.routed_experts``), exactly as SGLang sends it. A request aborted
  before its prompt was ever prefilled computed no position: (0, num_layers, top_k).
- Weight versions are ints in asyncrl (the trainer's, ordered: staleness is a difference of
  versions); every output token carries the version of the weights that produced it
  (``output_token_weight_versions``), so a request spanning a weight update is visible. On the
  wire they are SGLang's opaque string labels (``weight_version: Optional[str]``, ``"default"``
  until a load names one): asyncrl names version v ``"v"`` when it loads weights and reads the
  labels engines report back as ints — :func:`weight_version_label` and
  :func:`parse_weight_version` are the only two places that convert.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

FinishType = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")

# SGLang sampling parameters the embedded engine does not implement; accepted only at the value
# that disables them, so a request relying on one fails loudly instead of being sampled wrongly.
_NEUTRAL_SAMPLING_PARAMS: dict[str, Any] = {
    "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_p": 0.0, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "logit_bias": None, "custom_params": None, "stop_regex": None,
}
# Accepted and ignored: they only shape streaming/detokenisation details.
_IGNORED_SAMPLING_PARAMS = ("spaces_between_special_tokens", "stream_interval")


class RolloutEngineError(RuntimeError):
    """An engine (or every engine behind a router) could not answer; the message names the fix."""


class EngineRequestError(RolloutEngineError):
    """The engine rejected the request itself (HTTP 4xx): retrying elsewhere would not help."""


@dataclass(frozen=True)
class SamplingParams:
    """How one prompt is sampled (SGLang ``sampling_params``).

    max_new_tokens: most tokens to generate (also capped by the model's context length).
    temperature: softmax temperature; 0 means greedy (argmax).
    top_p: nucleus sampling: keep the most likely tokens until their mass reaches top_p (1 = off).
    top_k: keep the k most likely tokens (-1 = off).
    stop_token_ids: extra token ids that end the response (the EOS token always does, unless
        ``ignore_eos``).
    stop: strings that end the response when they appear in the decoded output.
    n: samples of this prompt (returned together, in order).
    seed: per-request sampling seed (SGLang ``sampling_seed``); sample j of n uses seed + j.
        None: the engine draws one.
    ignore_eos: keep generating past EOS (for fixed-length benchmarks).
    skip_special_tokens: drop special tokens from the returned ``text``.
    no_stop_trim: keep a matched stop string at the end of ``text``.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens} (prompt "
                             "log-probs come from the trainer, not the rollout engine)")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_sglang(self) -> dict[str, Any]:
        """The ``sampling_params`` JSON object SGLang and the embedded server accept."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "n": self.n,
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            out["stop"] = list(self.stop)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out

    @classmethod
    def from_sglang(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Parse a ``sampling_params`` object. Anything malformed (not an object, a field of the
        wrong type, an unknown or unsupported field) raises ValueError naming the field."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a JSON object such as "
                             f'{{"max_new_tokens": 16}}, got {brief_repr(d)}')
        d = dict(d)
        kwargs: dict[str, Any] = {}
        for name in ("max_new_tokens", "top_k", "n"):
            if d.get(name) is not None:
                kwargs[name] = _as_int(d.pop(name), f"sampling_params.{name}")
            d.pop(name, None)
        for name in ("temperature", "top_p"):
            if d.get(name) is not None:
                kwargs[name] = _as_float(d.pop(name), f"sampling_params.{name}")
            d.pop(name, None)
        if kwargs.get("top_k") == 0:  # vLLM spells "off" as 0
            kwargs["top_k"] = -1
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if d.get(name) is not None:
                kwargs[name] = _as_bool(d.pop(name), f"sampling_params.{name}")
            d.pop(name, None)
        seed = d.pop("sampling_seed", None)
        alias = d.pop("seed", None)
        if seed is None:
            seed = alias
        if seed is not None:
            kwargs["seed"] = _as_int(seed, "sampling_params.sampling_seed")
        stop = d.pop("stop", None)
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ValueError(f"sampling_params.stop must be a string or a list of strings, "
                                 f"got {brief_repr(stop)}")
            kwargs["stop"] = tuple(stops)
        stop_ids = d.pop("stop_token_ids", None)
        if stop_ids is not None:
            if not isinstance(stop_ids, list):
                raise ValueError(f"sampling_params.stop_token_ids must be a list of token ids "
                                 f"such as [2], got {brief_repr(stop_ids)}")
            kwargs["stop_token_ids"] = tuple(_as_int(t, "sampling_params.stop_token_ids[]")
                                             for t in stop_ids)
        for name in _IGNORED_SAMPLING_PARAMS:
            d.pop(name, None)
        for name, neutral in _NEUTRAL_SAMPLING_PARAMS.items():
            if name in d:
                value = d.pop(name)
                if value is not None and value != neutral:
                    raise ValueError(f"sampling_params.{name}={brief_repr(value)} is not "
                                     f"supported by this engine; leave it at {neutral!r}")
        if d:
            raise ValueError(f"unknown sampling_params {sorted(d)}; supported: max_new_tokens, "
                             "temperature, top_p, top_k, stop, stop_token_ids, n, sampling_seed, "
                             "ignore_eos, skip_special_tokens, no_stop_trim")
        return cls(**kwargs)


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to sample ``sampling.n`` responses for.

    input_ids: prompt token ids (starting with <bos>).
    sampling: sampling parameters.
    return_logprob: return the log-prob of every output token (RL needs it; on by default, unlike
        SGLang's API default).
    return_routed_experts: return the experts chosen at every position (MoE engines; the SGLang
        server needs ``--enable-return-routed-experts``).
    routed_experts_start_len: first position whose routes are returned (SGLang semantics).
    rid: request id, for ``abort``; the engine makes one when None.
    expected_new_tokens: the caller's estimate of the response length (e.g. length-aware
        dispatch's EMA per prompt); the router balances on it instead of ``max_new_tokens``.
        Not sent to the engine.
    """

    input_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = True
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    rid: str | None = None
    expected_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if len(self.input_ids) == 0:
            raise ValueError("input_ids is empty; a prompt starts with the <bos> token")
        if self.routed_experts_start_len < 0:
            raise ValueError("routed_experts_start_len must be >= 0")

    @property
    def estimated_tokens(self) -> int:
        """Upper bound of the tokens this request occupies on an engine (load balancing)."""
        per_sample = self.sampling.max_new_tokens
        if self.expected_new_tokens is not None:
            per_sample = max(1, min(per_sample, int(self.expected_new_tokens)))
        return len(self.input_ids) + per_sample * self.sampling.n

    def to_sglang(self) -> dict[str, Any]:
        """The ``POST /generate`` JSON body."""
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in self.input_ids],
            "sampling_params": self.sampling.to_sglang(),
            "return_logprob": self.return_logprob,
        }
        if self.return_routed_experts:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = self.routed_experts_start_len
        if self.rid is not None:
            body["rid"] = self.rid
        return body


@dataclass
class GenerateResult:
    """One sampled response.

    prompt_ids: the prompt (P tokens).
    output_ids: generated ids (O tokens; includes the stop token when one ended the response).
    output_logprobs: (O,) log-prob of each output token under the sampled distribution, or None
        when not requested.
    finish_reason: "stop" | "length" | "abort".
    finish_detail: SGLang's full ``finish_reason`` object (e.g. ``{"type": "stop", "matched": 2}``).
    weight_version: the version of the weights that produced the last token (the engine's
        version when none was produced), as SGLang reports it.
    output_token_weight_versions: (O,) the weight version that produced each token (equal to
        ``weight_version`` everywhere unless the request spanned a weight update).
    routed_experts: (P + O − 1 − start, num_layers, top_k) int32 expert ids, or None;
        (0, num_layers, top_k) for a request aborted before its prompt was prefilled.
    text: the decoded output.
    rid: the engine's request id.
    engine_url: which engine answered (filled by the client).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: str
    finish_detail: dict[str, Any]
    weight_version: int
    output_token_weight_versions: list[int]
    routed_experts: np.ndarray | None = None
    text: str = ""
    rid: str | None = None
    engine_url: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @property
    def spans_weight_update(self) -> bool:
        return len(set(self.output_token_weight_versions)) > 1

    @classmethod
    def from_sglang(cls, out: dict[str, Any], prompt_ids: Sequence[int],
                    moe_layout: tuple[int, int] | None = None,
                    engine_url: str | None = None) -> GenerateResult:
        """Parse one ``/generate`` response object.

        Args:
            out: ``{"text", "output_ids", "meta_info": {...}}``.
            prompt_ids: the prompt that was sent.
            moe_layout: (num_layers, top_k) to shape ``routed_experts``; required when the
                response carries routed experts.
            engine_url: recorded on the result.
        """
        meta = out.get("meta_info", {})
        output_ids = [int(t) for t in out.get("output_ids", [])]
        lp = meta.get("output_token_logprobs")
        logprobs = None if lp is None else [float(x[0]) for x in lp]
        if lp and [int(x[1]) for x in lp] != output_ids[-len(lp):]:
            raise RolloutEngineError("engine returned log-probs for other tokens than "
                                     "output_ids; is the engine streaming incrementally?")
        finish = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"}
        if isinstance(finish, str):  # some servers send the bare type
            finish = {"type": finish}
        version = parse_weight_version(meta.get("weight_version"))
        versions = meta.get("output_token_weight_versions")
        if versions is not None:  # asyncrl's embedded engine: one per token
            token_versions = [parse_weight_version(v) for v in versions]
        else:
            token_versions = _versions_from_spans(meta.get("weight_versions"), version,
                                                  len(output_ids))
        routes = None
        if meta.get("routed_experts") is not None:
            if moe_layout is None:
                raise RolloutEngineError("response has routed_experts but the MoE layout is "
                                         "unknown; pass moe_layout=(num_layers, top_k)")
            routes = decode_routed_experts(meta["routed_experts"], *moe_layout)
        return cls(prompt_ids=[int(t) for t in prompt_ids], output_ids=output_ids,
                   output_logprobs=logprobs, finish_reason=str(finish.get("type")),
                   finish_detail=dict(finish), weight_version=version,
                   output_token_weight_versions=token_versions, routed_experts=routes,
                   text=str(out.get("text", "")), rid=meta.get("id"), engine_url=engine_url)


@dataclass(frozen=True)
class WeightUpdateResult:
    """Answer of ``/update_weights_from_disk`` (per engine when a router fans it out)."""

    success: bool
    message: str
    engine_url: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What an engine serves (``GET /model_info``).

    num_layers / top_k / num_experts are None when the server does not report them (SGLang's
    ``/model_info`` does not; the client then reads ``config.json`` at ``model_path`` if local).
    """

    model_path: str
    weight_version: int
    num_layers: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    vocab_size: int | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def moe_layout(self) -> tuple[int, int] | None:
        if self.num_experts and self.num_layers and self.top_k:
            return self.num_layers, self.top_k
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelInfo:
        def opt_int(*keys: str) -> int | None:
            for k in keys:
                if d.get(k) is not None:
                    return int(d[k])
            return None

        return cls(model_path=str(d.get("model_path", "")),
                   weight_version=parse_weight_version(d.get("weight_version")),
                   num_layers=opt_int("num_hidden_layers", "num_layers"),
                   num_experts=opt_int("num_local_experts", "num_experts"),
                   top_k=opt_int("num_experts_per_tok", "top_k"),
                   vocab_size=opt_int("vocab_size"), raw=dict(d))


@runtime_checkable
class RolloutEngine(Protocol):
    """What an RL trainer needs from a rollout backend (one engine or a routed fleet).

    Implemented over HTTP by ``training.engines.client.RolloutClient`` (asyncio) for the embedded
    server and SGLang servers alike; ``SyncRolloutClient`` offers the same methods blocking.
    """

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[list[GenerateResult]]:
        """Sample every request; result i holds the ``requests[i].sampling.n`` samples."""
        ...

    async def update_weights_from_disk(self, path: str, version: int,
                                       abort_all_requests: bool = False
                                       ) -> list[WeightUpdateResult]:
        """Load HF-format weights from ``path`` and report ``version`` from now on."""
        ...

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop decoding: ``abort`` finishes running requests (partial output, finish "abort"),
        ``retract`` frees their KV caches and re-prefills them on continue, ``in_place`` holds
        them with their caches."""
        ...

    async def continue_generation(self) -> None:
        ...

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or every request when ``rid`` is None."""
        ...

    async def health(self) -> bool:
        ...

    async def model_info(self) -> ModelInfo:
        ...


# ------------------------------------------------------------------------------------------------
# routed-experts codec and small parsers
# ------------------------------------------------------------------------------------------------


def encode_routed_experts(routes: np.ndarray) -> str:
    """(N, L, k) expert ids → base64 of the row-major int32 bytes (SGLang's wire format)."""
    arr = np.ascontiguousarray(np.asarray(routes, dtype=np.int32))
    return base64.b64encode(arr.tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_layers: int, top_k: int) -> np.ndarray:
    """base64 int32 bytes → (N, num_layers, top_k) int32 array."""
    flat = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    if flat.size % (num_layers * top_k):
        raise RolloutEngineError(f"routed_experts has {flat.size} ids, not a multiple of "
                                 f"num_layers*top_k = {num_layers * top_k}; wrong moe_layout?")
    return flat.reshape(-1, num_layers, top_k).copy()


def _versions_from_spans(spans: Any, last: int, n: int) -> list[int]:
    """Per-token versions from SGLang's ``meta_info.weight_versions`` (0.5.23; sent when the
    weights changed while the request ran): ``[{"version", "start", "end"}]``, output token
    indices ``[start, end)``; tokens no span covers have the request's final ``weight_version``."""
    out = [last] * n
    if spans is None:
        return out
    try:
        for span in spans:
            v = parse_weight_version(span["version"])
            start, end = int(span["start"]), min(int(span["end"]), n)
            out[max(0, start):end] = [v] * max(0, end - max(0, start))
    except (KeyError, TypeError, ValueError) as e:
        raise RolloutEngineError(f"meta_info.weight_versions {brief_repr(spans)} is not a list "
                                 f"of {{version, start, end}} spans ({e})") from None
    return out


def weight_version_label(version: int) -> str:
    """The ``weight_version`` asyncrl sends for its integer ``version`` (SGLang's field is a
    string): ``"7"`` for 7."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"an asyncrl weight version is an integer >= 0, got {version!r}")
    return str(version)


def parse_weight_version(label: Any) -> int:
    """asyncrl's integer version from a ``weight_version`` an engine reports: the inverse of
    :func:`weight_version_label`. SGLang's label before any named load, ``"default"`` (or no
    label), is the starting weights, 0. A bare JSON integer is read as its label would be (older
    asyncrl engines sent them). Any other label was not given by asyncrl: RolloutEngineError."""
    if label is None or label == "default":
        return 0
    if isinstance(label, int) and not isinstance(label, bool) and label >= 0:
        return label
    if isinstance(label, str) and label.isascii() and label.isdigit():
        return int(label)
    raise RolloutEngineError(
        f"the engine reports weight_version {brief_repr(label)}, a label asyncrl did not give: "
        "asyncrl names the weights it loads by their integer version (\"7\"); load weights "
        "through asyncrl, or label them with an integer")


def brief_repr(v: Any, limit: int = 60) -> str:
    """A short one-line repr of a JSON value for error messages."""
    text = repr(v).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _as_int(v: Any, name: str) -> int:
    if (isinstance(v, bool) or not isinstance(v, int | float)
            or (isinstance(v, float) and not math.isfinite(v)) or int(v) != v):
        raise ValueError(f"{name} must be an integer, got {brief_repr(v)}")
    return int(v)


def _as_float(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {brief_repr(v)}")
    return float(v)


def _as_bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be true or false, got {brief_repr(v)}")
    return v
