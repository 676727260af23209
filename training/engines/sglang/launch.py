"""The exact command line and environment of an SGLang server (and of sglang-router) for a recipe.

Pure functions, no SGLang import: the server is a separate process, and these are unit-tested
argument by argument. Every flag below is documented for SGLang 0.5.x
(``python -m sglang.launch_server --help``; docs "Server Arguments"):

- ``--model-path`` the HF directory the engine starts from (asyncrl's checkpoints and weight
  exports are HF directories, DESIGN.md "Engines"); ``--weight-version`` its asyncrl weight version
  (``asyncrl.json``), so ``meta_info.weight_version`` and ``/model_info`` report it from the first
  token instead of SGLang's ``"default"``;
- ``--host`` / ``--port``: 127.0.0.1 on a one-node cluster, else the node's cluster address (the
  rollouter may run on another node; the server has no authentication);
- ``--tp-size``, ``--mem-fraction-static``: ``engines.sglang``;
- ``--dtype bfloat16``: SGLang's ``auto`` serves an fp32 checkpoint (what asyncrl writes) in
  **fp16**; the embedded engine and the seeds' SGLang runs sample in bf16;
- ``--skip-tokenizer-init``: asyncrl always sends ``input_ids`` and stops on ``stop_token_ids``,
  decoding the output itself, so SGLang needs no tokenizer ("skip init tokenizer and pass input_ids
  in generate request"); ``text`` prompts and ``stop`` strings are then unavailable (not used);
- ``--random-seed``: recipe seed + engine index (engines sample differently, reproducibly);
- ``--max-running-requests``: ``engines.max_batch`` (the most sequences one server decodes);
- ``--enable-return-routed-experts`` with ``algorithm.routing_replay: r3`` (the rollout's routes
  are replayed by the trainer; per request ``return_routed_experts``);
- ``--enable-deterministic-inference`` with ``engines.sglang.deterministic`` (batch-invariant
  kernels; also what makes ``sampling_seed`` reproducible);
- then ``engines.sglang.extra_args`` verbatim: argparse keeps the last occurrence of an option, so
  an extra ``--dtype float16`` overrides the one above.

No server flag is needed for log-probs: each ``/generate`` asks ``return_logprob``. Their meaning:
SGLang reports log softmax(logits / temperature) *before* top-k / top-p truncation, asyncrl's
convention (``training.engines.rollout``) is the truncated, renormalised distribution; the two
agree when top_p = 1 and top_k = -1 (asyncrl's recipes). ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (raw
pre-temperature log-probs) is removed from the server's environment for that reason.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from training.engines.rollout import weight_version_label
from training.recipe import Recipe

__all__ = [
    "ROUTER_MISSING", "SGLANG_MISSING", "BackendUnavailable", "ServerSpec", "require_router",
    "require_sglang", "router_command", "server_args", "server_command", "server_env",
]

SGLANG_MISSING = ('engines.rollout: sglang needs SGLang on a GPU node; install it with '
                  'pip install -e ".[gpu]"')
ROUTER_MISSING = ("engines.sglang.router: sglang-router needs the sglang-router package on the "
                  "driver node; install it with pip install sglang-router, or use router: asyncrl")
# Set by users comparing raw logits; it changes what output_token_logprobs mean (module docstring).
_DROPPED_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


class BackendUnavailable(RuntimeError):
    """A rollout backend the recipe chose cannot run here; the message is one line with the fix."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_sglang() -> None:
    """Raise :class:`BackendUnavailable` (:data:`SGLANG_MISSING`) unless SGLang is importable."""
    if not _installed("sglang"):
        raise BackendUnavailable(SGLANG_MISSING)


def require_router() -> None:
    if not _installed("sglang_router"):
        raise BackendUnavailable(ROUTER_MISSING)


@dataclass(frozen=True)
class ServerSpec:
    """What differs between the engines of one run.

    model_path: HF directory to serve (the run's initial checkpoint, or the current weights).
    port / host: where the server listens.
    weight_version: the asyncrl weight version of ``model_path``.
    index: the engine's index in the fleet (seeds its sampling).
    """

    model_path: str
    port: int
    host: str = "127.0.0.1"
    weight_version: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.index < 0 or self.weight_version < 0:
            raise ValueError("index and weight_version must be >= 0")


def server_args(recipe: Recipe, spec: ServerSpec) -> list[str]:
    """The ``sglang.launch_server`` arguments for engine ``spec.index`` of ``recipe``."""
    s = recipe.engines.sglang
    args = [
        "--model-path", str(spec.model_path),
        "--host", spec.host,
        "--port", str(spec.port),
        "--tp-size", str(s.tp_size),
        "--mem-fraction-static", repr(float(s.mem_fraction_static)),
        "--dtype", "bfloat16",
        "--skip-tokenizer-init",
        "--weight-version", weight_version_label(int(spec.weight_version)),
        "--random-seed", str(recipe.seed + spec.index),
        "--max-running-requests", str(recipe.engines.max_batch),
    ]
    if recipe.routing_replay == "r3":
        args.append("--enable-return-routed-experts")
    if s.deterministic:
        args.append("--enable-deterministic-inference")
    return [*args, *s.extra_args]


def server_command(recipe: Recipe, spec: ServerSpec, python: str | None = None) -> list[str]:
    """``[python, -m, sglang.launch_server, *server_args]``."""
    return [python or sys.executable, "-m", "sglang.launch_server", *server_args(recipe, spec)]


def server_env(base: Mapping[str, str], gpu_ids: Sequence[int | str], tp_size: int
               ) -> dict[str, str]:
    """The server's environment: ``base`` with ``CUDA_VISIBLE_DEVICES`` = the GPUs Ray assigned
    to the engine's actor (``ray.get_gpu_ids()``), one per tensor-parallel rank.

    With no ids (a CPU-only test) CUDA_VISIBLE_DEVICES is left as in ``base``. Raises ValueError
    when the ids do not match ``tp_size`` (the actor asked Ray for tp_size GPUs).
    """
    env = {k: v for k, v in base.items() if k not in _DROPPED_ENV}
    ids = [str(i) for i in gpu_ids]
    if ids:
        if len(ids) != tp_size:
            raise ValueError(f"engine got GPUs {ids} but engines.sglang.tp_size is {tp_size}; "
                             "each engine needs exactly tp_size GPUs")
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine got duplicate GPU ids {ids}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    return env


def router_command(worker_urls: Sequence[str], *, port: int, prometheus_port: int,
                   host: str = "127.0.0.1", policy: str = "cache_aware",
                   python: str | None = None) -> list[str]:
    """``python -m sglang_router.launch_router`` over ``worker_urls``.

    Its Prometheus endpoint defaults to 0.0.0.0:29000 (FACTS.md): it is bound to ``host`` on a
    port of our choosing, so two runs on a node do not collide and nothing listens publicly.
    """
    if not worker_urls:
        raise ValueError("sglang-router needs at least one worker URL")
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy {policy!r} is not one of {ROUTER_POLICIES}")
    return [python or sys.executable, "-m", "sglang_router.launch_router",
            "--worker-urls", *worker_urls, "--policy", policy, "--host", host,
            "--port", str(port), "--prometheus-host", host,
            "--prometheus-port", str(prometheus_port)]
