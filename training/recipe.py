"""The recipe: everything one training run needs, as a validated pydantic model (YAML on disk).

A recipe is what a campaign stage promotes and what ``asyncrl train RECIPE.yaml`` runs. Sections
(DESIGN.md "Recipe and campaign"):

- ``model``: where the initial weights come from — the cached embedded warm start (``kind:
  warmstart``, dense or MoE) or an HF-format checkpoint directory (``kind: checkpoint``).
- ``engines``: rollout / train backends and how many rollout servers.
- ``task``: the verifiable task, its arguments, the training difficulty mix and the eval set.
- ``rollout``: group size n, prompts per mini-batch, sampling temperature, response cap.
- ``async``: ``sync`` | ``one_step`` | ``fully_async`` (a discriminated union on ``mode``) with
  seed 002's knobs (staleness_threshold, trigger_parameter_sync_step, require_batches,
  partial_rollout), seed 004's max-ahead limit and ``max_off_policy_steps``.
- ``data``: drain policy of the sample buffer and dispatch order (seed 000, stage 3).
- ``algorithm``: advantage estimator, policy loss, old-log-prob strategy, IS/RS correction
  (CompIS, a rollout-correction preset, decoupled PPO, or none), M2PO, OPSM, routing replay, KL.
- ``optim``: learning rate, schedule, PPO epochs, gradient clipping.
- ``eval``: held-out evaluation every N steps, per difficulty bucket.
- ``steps``, ``seed``.

Every field has bounds and a description (exported in the JSON schema, ``asyncrl schema recipe``);
cross-field rules are validators whose message says how to fix the recipe. Names of losses,
estimators, presets and tasks are checked against the algorithm/task registries and the error lists
the valid ones. :func:`recipe_hash` is the stable identity of a recipe (the ``name`` and
``description`` are labels and do not count).

Hostile input (issue 13): a recipe file is read by :func:`training.yamlfile.read_yaml` (plain data
only, no aliases, bounded size and depth); every integer field has an upper bound, no float field
takes ``.inf``/``.nan``, a boolean field takes only true/false and a number field never a
boolean; ``task.args`` and overrides are plain data (:func:`apply_overrides` copies them without a
JSON round trip); the ``name``, which names the run directory, matches :data:`NAME_PATTERN` per
``/``-separated part (a campaign's candidates are ``<campaign>/<stage>/<candidate>``), so it can
never step out of ``$ASYNCRL_HOME/runs``. Every problem is one :class:`RecipeError` line.

This module imports pydantic and yaml, and checks names against the torch-free
:mod:`training.algorithms.names` (the registries require the same names), so checking a recipe
needs no torch (``asyncrl validate``).
"""

from __future__ import annotations

import functools
import math
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from training.algorithms.names import LOSS_AGG_MODES, NAMES
from training.recipe_identity import recipe_hash
from training.yamlfile import (
    PlainDataError,
    UnionTags,
    YamlBool,
    YamlFloat,
    YamlInt,
    YamlOptFloat,
    YamlOptInt,
    describe,
    escape_controls,
    format_validation_error,
    plain_copy,
    read_yaml,
    require_mapping,
    short_repr,
)

__all__ = [
    "NAME_PATTERN",
    "OLD_LOGPROB_STRATEGIES",
    "AlgorithmConfig",
    "AsyncConfig",
    "OldLogprob",
    "Recipe",
    "RecipeError",
    "apply_overrides",
    "check_path_name",
    "load_recipe",
    "recipe_from_dict",
    "recipe_hash",
    "recipe_json_schema",
]


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the field and the fix (one line)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              allow_inf_nan=False)


# One part of a name that becomes a path (a run directory, a campaign's MLflow experiment, a
# stage's model alias): it starts with a letter or digit, so it is never "..", "." or "-x".
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_NAME = re.compile(NAME_PATTERN)
_RECIPE_NAME = re.compile(rf"{NAME_PATTERN}(?:/{NAME_PATTERN}){{0,2}}")
_NAME_RULE = "1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"


def check_path_name(value: str, what: str) -> str:
    """``value`` if it matches :data:`NAME_PATTERN` (the whole of it); else a ValueError naming
    ``what`` and the rule."""
    if not _NAME.fullmatch(value):
        raise ValueError(f"{what} {short_repr(value)} must be {_NAME_RULE}")
    return value


def _no_control_chars(value: str, what: str) -> str:
    if not value.isprintable():
        raise ValueError(f"{what} {short_repr(value)} contains a control character; remove it")
    return value


def _check_name(value: str, kind: str, what: str) -> str:
    """``value`` if it is a name of registry ``kind`` (:data:`training.algorithms.names.NAMES`,
    torch-free: the registries require the same names), else a one-line ValueError."""
    valid = NAMES[kind]
    if value not in valid:
        shown = [n for n in LOSS_AGG_MODES if n in valid] if kind == "agg" else sorted(valid)
        raise ValueError(f"unknown {what} {short_repr(value)}; use one of: {', '.join(shown)}")
    return value


# --- model ---------------------------------------------------------------------------------------


class WarmStartModel(_Strict):
    """The embedded model, supervised-warm-started on the recipe's task (cached by config hash
    under $ASYNCRL_HOME/cache/warmstart; ``asyncrl warmstart`` builds the same checkpoint)."""

    kind: Literal["warmstart"] = Field("warmstart", description=(
        "Variant tag: the cached embedded warm start."))
    moe_experts: YamlInt = Field(0, ge=0, le=64, description=(
        "0 = dense; else upcycle the dense warm start to this many experts per layer (MoE)."))
    moe_top_k: YamlInt = Field(2, ge=1, le=8, description="Experts per token of the MoE model.")
    warmstart_steps: YamlInt = Field(700, ge=0, le=100_000, description=(
        "Supervised warm-start steps (700 reaches ~1.0 greedy accuracy at k=2 on sum_digits)."))
    hidden_size: YamlInt = Field(128, ge=16, le=4096, description="Model width d.")
    num_layers: YamlInt = Field(4, ge=1, le=64, description="Transformer layers.")
    seed: YamlOptInt = Field(None, ge=0, le=2**31 - 1, description=(
        "Seed of the warm start; null (default) takes the recipe's seed. A campaign's extra "
        "seeds (stage or candidate `seeds:`) pin it, so every seed starts from the same "
        "weights."))

    @model_validator(mode="after")
    def _top_k(self) -> WarmStartModel:
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise ValueError(f"moe_top_k={self.moe_top_k} exceeds moe_experts={self.moe_experts}; "
                             "lower moe_top_k")
        return self


class CheckpointModel(_Strict):
    """An HF-format checkpoint directory (config.json, model.safetensors, tokenizer.json), e.g.
    a previous run's ``final/hf`` or a promoted checkpoint. Missing or unreadable → the run
    refuses to start (never random weights)."""

    kind: Literal["checkpoint"] = Field("checkpoint", description=(
        "Variant tag: an HF-format checkpoint directory."))
    path: str = Field(min_length=1, max_length=4096, description=(
        "Directory of the HF-format checkpoint."))
    origin: str | None = Field(None, pattern=r"^recipe:[0-9a-f]{16}$", description=(
        "The recipe whose run produced this checkpoint, as 'recipe:<hash>' (a campaign sets it "
        "on every stage after the first: the previous stage's promoted recipe). When set, the "
        "recipe's identity (its hash) counts the origin instead of the path, so the same ladder "
        "gives the same recipe hashes on every machine, home directory and campaign. None: the "
        "path counts."))
    moe_experts: YamlOptInt = Field(None, ge=0, le=64, description=(
        "Experts per layer of the checkpoint's model (0 = dense), when known (a campaign copies "
        "it from the origin recipe), so the recipe's MoE checks (routing_replay) apply to it. "
        "None: unknown here; the run reads config.json."))

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _no_control_chars(v, "checkpoint path")


ModelSpec = Annotated[WarmStartModel | CheckpointModel, Field(discriminator="kind")]


# --- engines, task, rollout ----------------------------------------------------------------------


class MegatronConfig(_Strict):
    """The Megatron train backend (``engines.train: megatron``; ``pip install -e ".[megatron]"``):
    megatron-core's GPTModel on Ray actors, one per rank (tensor × pipeline × data parallel; experts
    split over expert_parallel of the data-parallel ranks). On a machine without CUDA it runs on
    CPU with gloo."""

    tensor_parallel: YamlInt = Field(1, ge=1, le=64, description="Tensor-parallel size (TP).")
    pipeline_parallel: YamlInt = Field(1, ge=1, le=64, description=(
        "Pipeline-parallel size (PP): the layers split into this many equal stages; must divide "
        "the layer count."))
    expert_parallel: YamlInt = Field(1, ge=1, le=64, description=(
        "Expert-parallel size (EP, MoE only): the experts are split over this many "
        "data-parallel ranks; must divide data_parallel and the expert count."))
    data_parallel: YamlInt = Field(1, ge=1, le=1024, description=(
        "Data-parallel size (DP); ranks = TP × PP × DP."))
    gpus_per_rank: YamlFloat = Field(1.0, ge=0.0, le=8.0, description=(
        "GPUs each rank actor asks Ray for (ignored where no GPU exists: CPU ranks)."))
    distributed_optimizer: YamlBool = Field(False, description=(
        "Megatron's DistributedOptimizer (shards optimizer state over DP) instead of the plain "
        "FP32 optimizer."))
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy of the rank actors.")
    precision: Literal["fp32", "bf16"] = Field("fp32", description=(
        "Training precision. 'fp32' (default) matches the embedded trainer's numerics. 'bf16': "
        "bf16 weights and activations with fp32 master weights, fp32 gradient reduction and "
        "fp32 optimizer state (megatron's mixed-precision optimizer) — about half the GPU "
        "memory for weights and activations and faster matmuls on GPUs, and the precision the "
        "rollout engines run in; log-probs then differ from an fp32 trainer's by bf16 rounding. "
        "Exported and synced HF weights stay fp32 (the bf16 values); checkpoints record the "
        "precision and resume only with the same one."))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel


class SGLangConfig(_Strict):
    """The SGLang rollout backend (``engines.rollout: sglang``; GPU nodes, ``pip install -e
    ".[gpu]"``): ``python -m sglang.launch_server`` processes started by Ray actors."""

    tp_size: YamlInt = Field(1, ge=1, le=64, description="Tensor-parallel size of each engine "
                         "(GPUs per engine).")
    mem_fraction_static: YamlFloat = Field(0.8, gt=0.0, lt=1.0, description=(
        "Fraction of GPU memory SGLang reserves for weights + KV cache (its "
        "--mem-fraction-static)."))
    deterministic: YamlBool = Field(False, description=(
        "--enable-deterministic-inference (batch-invariant kernels; slower, less mismatch)."))
    router: Literal["asyncrl", "sglang-router"] = Field("asyncrl", description=(
        "Who balances requests: asyncrl's own router (default; carries routed experts for R3) or "
        "sglang-router (drops return_routed_experts, so not with routing_replay r3)."))
    weight_sync: Literal["disk", "nccl"] = Field("disk", description=(
        "How new weights reach the engines: an HF export loaded with /update_weights_from_disk, "
        "or NCCL broadcast from the Megatron ranks (/update_weights_from_distributed; GPUs only)."))
    startup_timeout_s: YamlFloat = Field(900.0, gt=0.0, le=7200.0, description=(
        "Seconds to wait for a launched engine's /health_generate."))
    max_restarts: YamlInt = Field(3, ge=0, le=100, description=(
        "Times a dead engine is restarted (and re-sent the current weights) before it is given "
        "up."))
    extra_args: list[str] = Field(default_factory=list, max_length=256, description=(
        "More sglang.launch_server arguments, passed through as given."))

    @field_validator("extra_args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        for arg in v:
            _no_control_chars(arg, "argument")
        return v


_RESOURCE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_:.\-]{0,63}$")


def _check_resources(v: dict[str, float], what: str) -> dict[str, float]:
    for name, amount in v.items():
        if not _RESOURCE_NAME.match(str(name)):
            raise ValueError(f"{what}: {name!r} is not a Ray resource name (letters, digits, "
                             "_ : . -; at most 64 characters)")
        if not math.isfinite(amount) or amount < 0 or amount > 10_000:
            raise ValueError(f"{what}: {name} = {amount} must be in [0, 10000]")
    if v.get("GPU", 0) and what.endswith("trainer"):
        raise ValueError(f"{what}: GPU is not for the trainer coordinator (the Megatron ranks "
                         "take their own GPUs, engines.megatron); name a custom resource instead")
    return v


class PlacementConfig(_Strict):
    """Where Ray puts the run's processes: one placement group per run, a bundle for the trainer
    (the rollouter and the sample buffer ride in it with no resources of their own) and one per
    embedded rollout engine. A run waits for its bundles, so the cluster's free resources decide
    how many runs fit at once; nothing of the run but the driver stays on the driver's machine.
    Where a run happens does not change what it computes: these fields are not part of the
    recipe hash."""

    trainer: dict[str, YamlFloat] = Field(default_factory=dict, description=(
        "Ray resources of the trainer's bundle, e.g. {train_node: 1} to pin it to the nodes "
        "started with --resources '{\"train_node\": N}'. CPU defaults to "
        "engines.train_threads."))
    rollout: dict[str, YamlFloat] = Field(default_factory=dict, description=(
        "Ray resources of each rollout engine's bundle. CPU defaults to "
        "engines.rollout_threads. SGLang engines add the custom resources here to their own "
        "bundle (1 CPU, engines.sglang.tp_size GPUs; CPU and GPU given here are ignored)."))
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description=(
        "Ray's placement strategy for the run's bundles: PACK (as few nodes as possible), "
        "SPREAD (as many as possible), STRICT_* (all on one node / each on its own)."))
    timeout_s: YamlFloat = Field(600.0, gt=0.0, le=86_400.0, description=(
        "Seconds a run waits for the cluster to have room for its bundles (e.g. while other "
        "candidates of a stage run) before it stops with the resources it lacks."))

    @field_validator("trainer")
    @classmethod
    def _trainer(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_resources(v, "engines.placement.trainer")

    @field_validator("rollout")
    @classmethod
    def _rollout(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_resources(v, "engines.placement.rollout")


class EnginesConfig(_Strict):
    """Rollout and training backends: the embedded CPU pair (default) or SGLang + Megatron."""

    rollout: Literal["embedded", "sglang"] = Field("embedded", description=(
        "Rollout backend: 'embedded' (HTTP servers around the torch engine, bf16 KV cache) or "
        "'sglang' (SGLang servers on GPUs, launched by Ray actors)."))
    train: Literal["embedded", "megatron"] = Field("embedded", description=(
        "Train backend: 'embedded' (fp32 torch on CPU) or 'megatron' (megatron-core ranks on Ray "
        "actors; CPU with gloo when there is no GPU)."))
    num_rollout_engines: YamlInt = Field(2, ge=1, le=64, description=(
        "Rollout servers behind the router (load-balanced by estimated tokens; a dead one's "
        "requests are retried on the others)."))
    rollout_dtype: Literal["bf16", "fp32", "fp8"] = Field("bf16", description=(
        "Embedded rollout numerics: bf16 (default, like SGLang), fp32 (no engine mismatch), fp8 "
        "(simulated weight quantisation, more mismatch)."))
    logit_noise: YamlFloat = Field(0.0, ge=0.0, le=5.0, description=(
        "Std of Gaussian noise added to embedded rollout logits (a knob to inject engine "
        "mismatch)."))
    max_batch: YamlInt = Field(64, ge=1, le=4096, description=(
        "Most sequences one rollout server decodes together."))
    rollout_threads: YamlInt = Field(1, ge=1, le=256, description=(
        "Torch threads of each embedded rollout server. 1 (default) keeps a server on one core, "
        "beside a 1-thread trainer (seed 002's resource isolation for async modes); in sync "
        "mode, where generation and training take turns, giving both all the cores (e.g. 2 and "
        "2 on a 2-core machine) lets each phase use the whole machine."))
    train_threads: YamlInt = Field(1, ge=1, le=256, description=(
        "Torch threads of the embedded trainer (see rollout_threads)."))
    snapshot_budget_mb: YamlInt = Field(256, ge=0, le=1_000_000, description=(
        "CPU memory for old weight versions kept by the trainer (old_logprob: snapshot, R2)."))
    megatron: MegatronConfig = Field(default_factory=MegatronConfig, description=(
        "Settings of the megatron train backend (used when train: megatron)."))
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description=(
        "Settings of the sglang rollout backend (used when rollout: sglang)."))
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description=(
        "Where Ray places the trainer and the rollout engines (resources per bundle, strategy); "
        "see docs/cluster.md."))

    def trainer_bundle(self) -> dict[str, float]:
        """The Ray resources of the trainer's bundle."""
        return {"CPU": float(self.train_threads), **self.placement.trainer}

    def rollout_bundle(self) -> dict[str, float]:
        """The Ray resources of one rollout engine's bundle."""
        cpu = 1.0 if self.rollout == "sglang" else float(self.rollout_threads)
        return {"CPU": cpu, **self.placement.rollout}

    @property
    def weight_transport(self) -> Literal["disk", "direct", "nccl"]:
        """How the parameter synchroniser moves new weights to the rollout engines: ``disk``
        (an HF export the rollouter's client loads on each engine: embedded, SGLang behind
        asyncrl's router), ``direct`` (the export loaded by each SGLang engine's actor, never
        through sglang-router) or ``nccl`` (a broadcast from the trainer)."""
        if self.rollout != "sglang":
            return "disk"
        if self.sglang.weight_sync == "nccl":
            return "nccl"
        return "direct" if self.sglang.router == "sglang-router" else "disk"


_MAX_DIFFICULTY = 1_000_000


class TaskConfig(_Strict):
    """The verifiable task (training.tasks registry)."""

    name: str = Field("sum_digits", description="Registered task name (asyncrl algorithms list "
                      "shows losses; tasks: sum_digits, jsonl, calc_chain).")
    args: dict[str, Any] = Field(default_factory=dict, description=(
        "Task constructor arguments, e.g. {min_k: 1, max_k: 8} for sum_digits or {path: "
        "data.jsonl, reward: numeric} for jsonl."))
    difficulty_weights: dict[YamlInt, YamlFloat] = Field(default_factory=dict, description=(
        "Training mix: relative weight of each difficulty bucket ({} = the task's balanced mix). "
        "A heavy weight on easy buckets with a few hard ones makes the long-tail task."))

    @field_validator("name")
    @classmethod
    def _task(cls, v: str) -> str:
        return _check_name(v, "task", "task")

    @field_validator("args")
    @classmethod
    def _args(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:  # strings, numbers, true/false, null, lists and mappings only; bounded; no cycles
            plain_copy(v)
        except PlainDataError as err:
            raise ValueError(str(err)) from None
        return v

    @field_validator("difficulty_weights")
    @classmethod
    def _weights(cls, v: dict[int, float]) -> dict[int, float]:
        if any(abs(k) > _MAX_DIFFICULTY for k in v):
            raise ValueError(f"difficulty buckets are integers in [-{_MAX_DIFFICULTY:,}, "
                             f"{_MAX_DIFFICULTY:,}]")
        if any(w < 0 or not math.isfinite(w) for w in v.values()):
            raise ValueError("difficulty weights must be finite and >= 0")
        if v and not any(w > 0 for w in v.values()):
            raise ValueError("at least one difficulty weight must be > 0")
        return v


class RolloutConfig(_Strict):
    """Sampling settings of the rollout engines."""

    n: YamlInt = Field(8, ge=1, le=1024, description="Samples per prompt (the GRPO group size).")
    batch_prompts: YamlInt = Field(8, ge=1, le=100_000, description=(
        "Prompts per mini-batch (seed 002's ppo_mini_batch_size). A trainer step consumes "
        "async.require_batches mini-batches."))
    temperature: YamlFloat = Field(1.0, gt=0.0, le=10.0, description=(
        "Sampling temperature; the trainer's log-probs use the same temperature."))
    top_p: YamlFloat = Field(1.0, gt=0.0, le=1.0, description=(
        "Nucleus sampling (1 = off). Truncation shows up as engine mismatch."))
    max_response_tokens: YamlInt = Field(32, ge=1, le=100_000, description=(
        "Response cap; longer responses are truncated (finish_reason length, counted in "
        "rollout/truncation_rate). For a tool task it caps the whole trajectory: every turn's "
        "tokens and the tool observations between them."))
    max_turns: YamlInt = Field(8, ge=1, le=1_000, description=(
        "Tool tasks only (e.g. calc_chain): most model turns per trajectory. A trajectory whose "
        "last allowed turn ends in a tool call stops there (finish_reason length, counted as "
        "truncated); single-turn tasks ignore it."))
    tool_timeout_s: YamlFloat = Field(2.0, gt=0.0, le=600.0, description=(
        "Tool tasks only: seconds a tool call may run; one that overruns gives the observation "
        "{timeout} and the trajectory goes on (counted in rollout/tool_timeouts)."))


# --- async ---------------------------------------------------------------------------------------


class _AsyncCommon(_Strict):
    require_batches: YamlInt = Field(1, ge=1, le=1024, description=(
        "Mini-batches per trainer step (seed 002): a step consumes require_batches × "
        "batch_prompts groups and makes one optimizer step per mini-batch and epoch."))
    max_ahead_steps: YamlOptInt = Field(None, ge=0, le=1_000, description=(
        "Seed 004's rate limit η: a sample may be submitted only while ⌊(N_r−1)/B⌋ ≤ i + η "
        "(N_r samples submitted, B samples per step, i the current step). None = off."))
    max_off_policy_steps: YamlOptInt = Field(None, ge=0, le=1_000, description=(
        "Samples more than this many steps behind the trainer when consumed are dropped and "
        "counted (async/dropped_stale_samples). None = keep all."))


class _Lockstep(_AsyncCommon):
    """A mode that generates exactly ``lag`` steps ahead of the trainer and syncs after every
    step: its meaning to the runtime is fixed by ``lag`` (sync 0, one_step 1).

    What each mode means is defined here once, as properties every consumer asks (the submission
    quota, the sync interval, the drain order, the staleness it produces and allows, the EWMA
    window), never worked out again from the mode's name."""

    _lag: ClassVar[int] = 0

    @property
    def quota_threshold(self) -> float:
        """Seed 002's staleness_threshold of the submission quota: (1 + lag) steps of samples
        between two syncs."""
        return float(self._lag)

    @property
    def sync_interval(self) -> int:
        """Trainer steps between two parameter syncs."""
        return 1

    @property
    def partial_rollout(self) -> bool:
        """Whether a sync interrupts in-flight generation (never: a lockstep batch is complete
        before the sync)."""
        return False

    @property
    def submission_order(self) -> bool:
        """Whether the buffer drains in submission order (so batch N is exactly the N-th
        submitted) instead of ``data.drain``."""
        return True

    @property
    def least_staleness(self) -> int:
        """The staleness (trainer steps) every sample of this mode has."""
        return self._lag

    @property
    def staleness_bound(self) -> int | None:
        """The most steps a consumed sample can be behind (None: unbounded)."""
        return self._lag

    @property
    def ewma_window(self) -> float:
        """Expected staleness W of the revised PPO-EWMA reference, in trainer steps."""
        return float(self._lag)


class SyncMode(_Lockstep):
    """On-policy pipeline: generate a step's batch with the current weights, train, sync."""

    _lag: ClassVar[int] = 0
    mode: Literal["sync"] = Field("sync", description="Variant tag: synchronous, on-policy.")


class OneStepMode(_Lockstep):
    """One-step off-policy: generate batch N+1 while training batch N (staleness ≤ 1)."""

    _lag: ClassVar[int] = 1
    mode: Literal["one_step"] = Field("one_step", description=(
        "Variant tag: one-step off-policy (staleness <= 1)."))


class FullyAsyncMode(_AsyncCommon):
    """Fully asynchronous streaming (seed 002): the rollouter never waits for the trainer except
    for the staleness limits."""

    mode: Literal["fully_async"] = Field("fully_async", description=(
        "Variant tag: fully asynchronous streaming."))
    staleness_threshold: YamlFloat = Field(0.5, ge=0.0, le=16.0, description=(
        "Seed 002: after a sync the rollouter may generate at most (1 + staleness_threshold) × "
        "trigger_parameter_sync_step × samples per step − stale samples (rollout_num). < 1 is "
        "recommended."))
    trigger_parameter_sync_step: YamlInt = Field(1, ge=1, le=1024, description=(
        "Trainer steps (local updates) between two parameter syncs to the rollout engines."))
    partial_rollout: YamlBool = Field(True, description=(
        "At a sync, pause the engines mid-generation, load the new weights and resume: "
        "interrupted samples keep their tokens and per-token versions. False: stop submitting "
        "and wait for in-flight requests to finish before syncing."))
    interrupt: Literal["auto", "retract", "abort_resume"] = Field("auto", description=(
        "How a partial rollout is interrupted at a sync. 'retract': the engine keeps each "
        "running sequence, re-prefills it under the new weights and reports the weight version "
        "of every token (the embedded engine per token, SGLang 0.5.23 as spans). "
        "'abort_resume' (seed 002: interrupted rollouts are saved and resumed): the engines "
        "abort in-flight requests, which return their tokens so far; after the load the "
        "rollouter sends prompt + those tokens back for the rest and labels each piece with the "
        "version that generated it. 'auto': retract on embedded engines, abort_resume on SGLang "
        "(whose retract drops the routed experts recorded before the re-prefill) and under "
        "algorithm.old_logprob interrupt (which needs the tokens back at the pause)."))

    # the same questions _Lockstep answers, for streaming
    @property
    def quota_threshold(self) -> float:
        return self.staleness_threshold

    @property
    def sync_interval(self) -> int:
        return self.trigger_parameter_sync_step

    @property
    def submission_order(self) -> bool:
        return False

    @property
    def least_staleness(self) -> int:
        """Samples generated right after a sync are consumed up to interval − 1 steps later."""
        return self.trigger_parameter_sync_step - 1

    @property
    def staleness_bound(self) -> int | None:
        return self.max_off_policy_steps

    @property
    def ewma_window(self) -> float:
        """(1 + staleness_threshold) · trigger_parameter_sync_step."""
        return (1.0 + self.staleness_threshold) * self.trigger_parameter_sync_step


AsyncSpec = Annotated[SyncMode | OneStepMode | FullyAsyncMode, Field(discriminator="mode")]
AsyncConfig = SyncMode | OneStepMode | FullyAsyncMode


class DataConfig(_Strict):
    """The data pipeline of seed 000 stage 3."""

    drain: Literal["fifo", "windowed_fifo"] = Field("windowed_fifo", description=(
        "fully_async only (sync/one_step consume whole batches in submission order): 'fifo' = "
        "naive arrival order (easy prompts finish first → simplicity bias); 'windowed_fifo' = "
        "only groups within `window` of the oldest unconsumed submitted group are eligible."))
    window: YamlInt = Field(16, ge=1, le=100_000, description="Windowed FIFO width, in groups.")
    dispatch: Literal["fifo", "length_aware"] = Field("length_aware", description=(
        "'length_aware': probe the first sample of each group at top priority, then dispatch "
        "the rest longest-expected first (EMA length cache per prompt: later epochs skip the "
        "probe); 'fifo': submission order."))
    length_ema: YamlFloat = Field(0.5, gt=0.0, le=1.0, description=(
        "EMA weight of a new length observation in the per-prompt length cache."))
    max_in_flight: YamlInt = Field(64, ge=1, le=100_000, description=(
        "Most sample requests outstanding at the engines at once."))


# --- algorithm -----------------------------------------------------------------------------------


# Registered estimators whose inputs the runtime never provides: the learner calls them with the
# token rewards, the mask and the group ids only (training.runtime.learner).
_UNPROVIDED_ESTIMATORS = {
    "gae": ("gae needs per-token values from a critic, and asyncrl trains no value model; use a "
            "critic-free estimator: grpo, rloo or reinforce_plus_plus"),
    "remax": ("remax needs the rewards of a greedy baseline rollout, which the runtime does not "
              "generate; use rloo (leave-one-out baseline) or grpo"),
}


class AdvantageSpec(_Strict):
    """Advantage estimator (training.algorithms.advantages) and its settings."""

    estimator: str = Field("grpo", description=(
        "Registered estimator, e.g. grpo, rloo, reinforce_plus_plus, optimal_token_baseline "
        "(IS-aware: reads the trainer's π, Σπ² and the correction's IS weights); Dr.GRPO = grpo "
        "with norm_by_std false. gae and remax are refused: the runtime has no value model "
        "(critic) and collects no greedy-baseline rewards."))
    norm_by_std: YamlBool = Field(True, description=(
        "grpo: divide by the group std (False = Dr.GRPO, seed 000 stage 4 fix 1)."))
    gamma: YamlFloat = Field(1.0, ge=0.0, le=1.0, description="Discount (gae, reinforce++).")
    lam: YamlFloat = Field(1.0, ge=0.0, le=1.0, description="GAE λ.")

    @field_validator("estimator")
    @classmethod
    def _name(cls, v: str) -> str:
        if v in _UNPROVIDED_ESTIMATORS:
            raise ValueError(_UNPROVIDED_ESTIMATORS[v])
        return _check_name(v, "advantage", "advantage estimator")


class LossSpec(_Strict):
    """Policy loss (training.algorithms.policy_loss) and its main settings."""

    name: str = Field("vanilla", description="Registered policy loss (vanilla = PPO clip, gspo, "
                      "cispo, sapo, ...).")
    agg: str = Field("token-mean", description="Loss aggregation: token-mean, token-sum (no "
                     "normaliser), seq-mean-token-sum, seq-mean-token-mean, "
                     "seq-mean-token-sum-norm (Dr.GRPO).")
    clip_ratio: YamlFloat = Field(0.2, gt=0.0, le=10.0, description="PPO ε.")
    clip_ratio_low: YamlOptFloat = Field(None, gt=0.0, le=10.0, description="ε_low (None = ε).")
    clip_ratio_high: YamlOptFloat = Field(None, gt=0.0, le=10.0, description=(
        "ε_high (clip-higher; None = ε)."))
    clip_ratio_c: YamlFloat = Field(3.0, gt=1.0, le=100.0, description="Dual-clip constant c.")
    entropy_coeff: YamlFloat = Field(0.0, ge=0.0, le=1.0, description="Entropy bonus coefficient.")
    loss_scale_factor: YamlOptFloat = Field(None, gt=0.0, le=1e7, description=(
        "Dr.GRPO's constant K of seq-mean-token-sum-norm (the loss is the per-sequence token "
        "sum / K). None = rollout.max_response_tokens; never the padded batch width, which "
        "changes from batch to batch."))
    dro_beta: YamlOptFloat = Field(None, gt=0.0, le=1e6, description=(
        "β of the dro loss's quadratic penalty ½β(log π_θ − log π_old)²; required by name: dro "
        "(no default, as in verl), unused by the other losses."))

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v, "loss", "policy loss")

    @field_validator("agg")
    @classmethod
    def _agg(cls, v: str) -> str:
        return _check_name(v, "agg", "loss aggregation")

    @model_validator(mode="after")
    def _dro_beta(self) -> LossSpec:
        if self.name == "dro" and self.dro_beta is None:
            raise ValueError("loss dro needs dro_beta > 0 (β of its quadratic log-ratio "
                             "penalty); add dro_beta to algorithm.loss")
        return self


class SourceSpec(_Strict):
    """One mismatch source's correction (seed 000's CompIS table)."""

    method: Literal["cap", "clip", "icepop", "none"] = Field(description=(
        "cap: zero tokens with ratio > upper; clip: clamp to [lower, upper]; icepop: zero tokens "
        "outside [lower, upper]; none: measure only."))
    lower: YamlOptFloat = Field(None, ge=0.0, description=(
        "Lower bound (None = method default)."))
    upper: YamlOptFloat = Field(None, gt=0.0, description=(
        "Upper bound (None = method default)."))

    @model_validator(mode="after")
    def _bounds(self) -> SourceSpec:
        if self.method == "cap" and self.lower is not None:
            raise ValueError("cap is one-sided: remove `lower` or use icepop/clip")
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"lower {self.lower} > upper {self.upper}; swap them")
        return self


class NoCorrection(_Strict):
    """No IS weights: the PPO ratio is π_θ / π_prox only."""

    kind: Literal["none"] = Field("none", description="Variant tag: no IS correction.")


class CompISCorrection(_Strict):
    """CompIS (seed 000): staleness ratio π_prox/π_old and engine ratio π_old/μ, each corrected by
    its own method; the PPO clip handles π_θ/π_prox. The defaults are seed 000's default
    configuration (after AReaL): a one-sided staleness cap and no engine correction; the two-sided
    engine IcePop of its "Fix 2" is explicit (``engine: {method: icepop}``)."""

    kind: Literal["compis"] = Field("compis", description=(
        "Variant tag: CompIS per-source correction."))
    staleness: SourceSpec = Field(default_factory=lambda: SourceSpec(method="cap"),
                                  description="Correction of r3 = π_prox/π_old (default cap 5).")
    engine: SourceSpec = Field(default_factory=lambda: SourceSpec(method="none"), description=(
        "Correction of r2 = π_old/μ (default none: measured, not corrected; seed 000's Fix 2 "
        "for long context is icepop, band [0.5, 5] by default)."))


class PresetCorrection(_Strict):
    """A rollout-correction preset of seed 001's table (verl's framework: token/sequence TIS,
    RS modes, bypass vs decoupled)."""

    kind: Literal["preset"] = Field("preset", description=(
        "Variant tag: a named rollout-correction preset."))
    name: str = Field(description="Preset name, e.g. decoupled_token_is, decoupled_geo_rs.")
    args: dict[str, Any] = Field(default_factory=dict, description=(
        "Keyword arguments of the preset's constructor, e.g. {is_threshold: 2.0, rs_threshold: "
        "'0.99_1.01'} (numbers or threshold strings); {} = the preset's defaults. Decoupled "
        "presets weigh π_prox/μ (the lag and the engine mismatch), bypass presets π_θ/μ."))

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v, "preset", "rollout-correction preset")

    @model_validator(mode="after")
    def _args(self) -> PresetCorrection:
        if self.args:  # the constructor decides (imports torch, only for a recipe with args)
            check_preset_args(self.name, self.args)
        return self


class DecoupledCorrection(_Strict):
    """Decoupled PPO (AReaL, seed 004): behaviour weight π_prox/μ, capped (reported under
    ``is/combined/*``)."""

    kind: Literal["decoupled"] = Field("decoupled", description=(
        "Variant tag: decoupled PPO."))
    behaviour_weight_cap: YamlOptFloat = Field(5.0, gt=0.0, description=(
        "Tokens with π_prox/μ above this are masked (None = no cap)."))


class DecoupledMISCorrection(_Strict):
    """Seed 003's decoupled correction in MIS form (Eq. 4): the PPO clip is centred at π_old
    (staleness correction, π_prox := π_old) and the train–inference discrepancy π_old/μ is
    repaired by its own mask (IcePop by default)."""

    kind: Literal["decoupled_mis"] = Field("decoupled_mis", description=(
        "Variant tag: PPO clip around π_old times a discrepancy correction of π_old/μ."))
    engine: SourceSpec = Field(default_factory=lambda: SourceSpec(method="icepop"), description=(
        "Correction of π_old/μ (default IcePop [0.5, 5]: tokens outside the band are masked)."))


CorrectionSpec = Annotated[
    NoCorrection | CompISCorrection | PresetCorrection | DecoupledCorrection
    | DecoupledMISCorrection,
    Field(discriminator="kind"),
]


def check_preset_args(name: str, args: Mapping[str, Any]) -> None:
    """ValueError (one line, naming the preset's arguments) unless ``PRESETS[name](**args)``
    builds a valid rollout-correction config."""
    import inspect

    from training.algorithms.rollout_correction import PRESETS

    ctor = PRESETS[name]
    valid = list(inspect.signature(ctor).parameters)
    takes = f"its arguments: {', '.join(valid)}" if valid else "it takes no arguments"
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ValueError(f"preset {name} has no argument {', '.join(unknown)} ({takes})")
    for key, value in args.items():
        if isinstance(value, bool) or not isinstance(value, int | float | str) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"preset {name} argument {key} must be a number or a threshold "
                             f"string like '0.5_5.0', got {describe(value)}")
    try:
        ctor(**args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"preset {name}: {e} ({takes})") from None


class EWMASpec(_Strict):
    """Revised PPO-EWMA reference (seed 003 §5.2)."""

    staleness_window: YamlOptFloat = Field(None, ge=0.0, le=1000.0, description=(
        "Expected staleness W (steps); β = W/(W+2). None = derived from the async mode."))
    reset_interval: YamlOptInt = Field(None, ge=1, le=10_000_000, description=(
        "Reset the reference to the current weights after this many updates (None = never)."))
    reset_mask_frac: YamlOptFloat = Field(0.1, gt=0.0, le=1.0, description=(
        "Reset when the train–inference mask on π_old/μ rejects more than this fraction of "
        "loss tokens (the correction's own mask; when the correction has none, the fraction "
        "outside the IcePop band [0.5, 5]). None = never by mask rate."))


class M2POSpec(_Strict):
    """M2PO second-moment masking (seed 000 stage 2)."""

    threshold: YamlFloat = Field(0.04, gt=0.0, description="Mean m2 target of the kept tokens.")
    max_cutoff: YamlOptFloat = Field(None, gt=0.0, description="Optional hard per-token cap.")


class OPSMSpec(_Strict):
    """Off-policy sequence masking (DeepSeek-V3.2, seed 001)."""

    delta: YamlFloat = Field(1e-4, gt=0.0, description=(
        "Negative-advantage sequences with mean log(μ/π) above δ are masked."))


class KLSpec(_Strict):
    """KL to the initial (reference) policy, as a penalty in the reward or a loss term."""

    mode: Literal["none", "in_reward", "in_loss"] = Field("none", description=(
        "'in_reward': token reward −= coef·KL(π_old ‖ π_ref); 'in_loss': coef·agg(KL term) is "
        "added to the policy loss, differentiated through π_θ (seed 001: k2, or k3 with an IS "
        "correction); 'none': off."))
    estimator: str = Field("k1", description="KL estimator: k1, abs, k2, k3, k1+, abs+, k3+.")
    coef: YamlFloat = Field(0.001, ge=0.0, le=10.0, description="Initial KL coefficient β.")
    target: YamlOptFloat = Field(None, gt=0.0, description=(
        "Adaptive controller target KL (None = fixed coefficient); mode in_reward only."))
    horizon: YamlInt = Field(10_000, ge=1, le=10_000_000, description=(
        "Adaptive controller horizon."))
    is_correction: Literal["none", "clipped", "deepseek_k3"] = Field("none", description=(
        "IS correction of the in_loss KL term, ρ = π_θ/π_old: none = the estimate as is "
        "(verl's use_kl_loss); clipped = min(ρ·k, clip(ρ, 1−ε_low, 1+ε_high)·k) with the "
        "loss's clip ratios (seed 004); deepseek_k3 = ρ·k3 (DeepSeek-V3.2's unbiased KL, needs "
        "estimator k3). The correction's rollout IS weights multiply both IS-corrected terms."))

    @field_validator("estimator")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v, "kl", "KL estimator")

    @model_validator(mode="after")
    def _loss_options(self) -> KLSpec:
        if self.is_correction != "none" and self.mode != "in_loss":
            raise ValueError(f"algorithm.kl.is_correction={self.is_correction} corrects the KL "
                             "loss term; set algorithm.kl.mode: in_loss or is_correction: none")
        if self.is_correction == "deepseek_k3" and self.estimator not in ("k3", "low_var_kl"):
            raise ValueError(f"algorithm.kl.is_correction=deepseek_k3 weights the k3 estimator; "
                             f"set algorithm.kl.estimator: k3 (not {self.estimator})")
        if self.mode == "in_loss" and self.target is not None:
            raise ValueError("algorithm.kl.target (the adaptive β) applies to mode in_reward; "
                             "remove target or use mode: in_reward")
        return self


class TurnSpec(_Strict):
    """Options for multi-turn tool trajectories (seed 004 source 5); single-turn tasks have one
    turn, where both options equal the trajectory form."""

    advantage: Literal["trajectory", "turn"] = Field("trajectory", description=(
        "trajectory = the estimator's advantage on every token; turn = a per-turn baseline: the "
        "tokens of turn t get (R − mean R) / (std R + ε) over the group's samples that reached "
        "turn t (std division only when advantage.norm_by_std); estimator grpo only."))
    is_ratio: Literal["trajectory", "turn"] = Field("trajectory", description=(
        "trajectory = sequence-level IS/RS statistics over the whole response; turn = each "
        "turn's tokens form their own sequence for sequence-level weights, vetoes and "
        "aggregates (turn-level ratio isolation: one turn's mismatch does not weigh the others)."))


OldLogprob = Literal["recompute", "snapshot", "dedicated", "interrupt", "ewma", "loglinear",
                     "linear_prox", "bypass"]
"""An ``algorithm.old_logprob`` strategy (the semantics of each: training.runtime.old_policy)."""
OLD_LOGPROB_STRATEGIES: tuple[OldLogprob, ...] = typing.get_args(OldLogprob)
# what each strategy's π_old is (seed 003): the meaning downstream code asks AlgorithmConfig for
# the trainer at each token's own version
_OLD_EXACT = frozenset({"snapshot", "dedicated", "interrupt"})
_OLD_IS_ROLLOUT = frozenset({"loglinear", "linear_prox", "bypass"})  # π_old ≡ μ


class AlgorithmConfig(_Strict):
    """The RL algorithm, every part selected by name from training.algorithms."""

    advantage: AdvantageSpec = Field(default_factory=AdvantageSpec, description=(
        "Advantage estimator and its settings."))
    loss: LossSpec = Field(default_factory=LossSpec, description=(
        "Policy loss, aggregation and clipping."))
    old_logprob: OldLogprob = Field(
        "snapshot", description=(
            "Where π_old and the PPO clip centre π_prox come from (seed 003): recompute = both "
            "the trainer weights the step starts from; snapshot = π_old exact (the trainer "
            "version that produced each token), π_prox the step's start weights; dedicated = "
            "π_old exact from a separate frozen model copy loaded with every version synced to "
            "the rollout engines (it holds the newest dedicated_versions of them; tokens of an "
            "older version take the step's start weights, counted in "
            "old/dedicated_fallback_frac; embedded trainer only), π_prox the step's start "
            "weights; interrupt = π_old exact, computed by the rollouter before each version "
            "leaves the engines (seed 003 §5.1, synchronization via partial rollout "
            "interruption): it holds an fp32 copy of the served weights, and at a sync the "
            "engines abort (async.interrupt abort_resume), it computes π_old of the tokens "
            "generated so far, then loads the new weights; a finished sample gets the rest "
            "(Sample.old_log_probs). A sample that arrives without them (not expected) falls "
            "back to the step's start weights, counted in old/interrupt_fallback_frac; "
            "embedded trainer, disk weight sync, no routing replay; π_prox the step's start "
            "weights; ewma = both the revised PPO-EWMA reference; loglinear = π_prox the A-3PO "
            "log-space interpolation log μ + α(log π_θ − log μ), π_old the rollout log-probs; "
            "linear_prox = π_prox AReaL's probability-space interpolation (1−α)μ + απ_θ with "
            "the same α, π_old the rollout log-probs; bypass = both the rollout log-probs. "
            "Correction kind decoupled_mis sets π_prox := π_old."))
    dedicated_versions: YamlInt = Field(2, ge=1, le=64, description=(
        "Synced weight versions the dedicated old-logit model holds (old_logprob: dedicated), "
        "the newest ones, each a full copy of the parameters: 1 covers sync mode, 2 one_step; "
        "fully async with a larger staleness needs more, or its older tokens fall back."))
    ewma: EWMASpec = Field(default_factory=EWMASpec, description=(
        "Revised PPO-EWMA reference settings (used when old_logprob is ewma)."))
    correction: CorrectionSpec = Field(default_factory=NoCorrection, description=(
        "IS/RS correction, by kind: none, compis, preset, decoupled or decoupled_mis."))
    m2po: M2POSpec | None = Field(None, description="M2PO masking (null = off).")
    opsm: OPSMSpec | None = Field(None, description="OPSM masking (null = off).")
    routing_replay: Literal["none", "r2", "r3", "auto"] = Field("none", description=(
        "MoE routing replay: r2 = the trainer's own earlier routes, r3 = the rollout's routes, "
        "auto = seed 004's choice by the off-policiness N (Recipe.off_policiness): N = 1 none, "
        "N = 2-3 r2, N >= 4 r3 (none for a model not known to be MoE); read the resolved value "
        "from Recipe.routing_replay."))
    kl: KLSpec = Field(default_factory=KLSpec, description=(
        "KL penalty to the initial policy (off by default)."))
    turns: TurnSpec = Field(default_factory=TurnSpec, description=(
        "Turn-level advantage and IS isolation for tool trajectories (seed 004 source 5)."))

    @model_validator(mode="after")
    def _combos(self) -> AlgorithmConfig:
        why = refused_combination(self.old_logprob, self.correction)
        if why is not None:
            raise ValueError(why)
        if self.turns.advantage == "turn" and self.advantage.estimator != "grpo":
            raise ValueError(f"turns.advantage turn is a per-turn GRPO baseline; set "
                             f"advantage.estimator grpo (got {self.advantage.estimator}) or "
                             "turns.advantage trajectory")
        return self

    @property
    def effective_old_logprob(self) -> OldLogprob:
        """The strategy the learner runs, decided here only (the learner's
        :func:`training.runtime.old_policy.old_policy` builds it): ``old_logprob``, except that a
        bypass rollout-correction preset forces bypass (every ``bypass_*`` preset, and only
        those, sets ``bypass_mode``)."""
        c = self.correction
        if isinstance(c, PresetCorrection) and c.name.startswith("bypass_"):
            return "bypass"
        return self.old_logprob

    @property
    def old_is_exact(self) -> bool:
        """π_old is the trainer at each token's own behaviour version (snapshot, dedicated),
        wherever that version is still held; recompute is exact only on tokens of the step's
        start version (:attr:`old_is_current`); the others never are."""
        return self.effective_old_logprob in _OLD_EXACT

    @property
    def old_is_current(self) -> bool:
        """π_old is the trainer at the step's start weights (recompute)."""
        return self.effective_old_logprob == "recompute"

    @property
    def has_distinct_old(self) -> bool:
        """π_old is a trainer-side policy, not the rollout log-probs μ (False under loglinear,
        linear_prox and bypass, where π_old ≡ μ and every π_old/μ ratio is 1)."""
        return self.effective_old_logprob not in _OLD_IS_ROLLOUT


def refused_combination(old_logprob: str, correction: CorrectionSpec) -> str | None:
    """Why a correction cannot work with an old-log-prob strategy (one line with the fix), or
    None. Bypass has π_prox = π_old = μ, so every ratio these corrections form is 1; loglinear
    and linear_prox have π_old = μ, so the clip of decoupled_mis would sit on the rollout
    log-probs."""
    c = correction
    if old_logprob == "bypass":
        if isinstance(c, CompISCorrection):
            return ("CompIS needs π_old distinct from the rollout log-probs; with old_logprob: "
                    "bypass use correction kind none or a bypass preset")
        if isinstance(c, DecoupledCorrection | DecoupledMISCorrection):
            return (f"correction kind {c.kind} weighs π_prox or π_old against the rollout "
                    "log-probs, which old_logprob: bypass makes equal (every weight is 1); use "
                    "old_logprob: snapshot, or a bypass preset")
        if isinstance(c, PresetCorrection) and c.name.startswith("decoupled_"):
            return (f"preset {c.name} weighs π_prox against the rollout log-probs, which "
                    "old_logprob: bypass makes equal (every weight is 1); use old_logprob: "
                    "snapshot, or a bypass_* preset")
    if old_logprob in _OLD_IS_ROLLOUT and isinstance(c, DecoupledMISCorrection):
        return (f"decoupled_mis centres the PPO clip at π_old, which {old_logprob} does not have "
                "(its π_old is the rollout log-probs); use old_logprob: snapshot or ewma")
    return None


class VCPOSpec(_Strict):
    """VCPO (Huang et al. 2026, seed 001 "ESS-guided variance control"): the learning rate of a
    trainer step scaled by the normalised effective sample size of its token IS weights,
    ESS = (Σw)² / (N·Σw²) ∈ (0, 1]: the weights the correction applies, or π_current/μ when it
    applies none."""

    min_scale: YamlFloat = Field(0.05, gt=0.0, le=1.0, description=(
        "Floor of the LR factor: lr × max(ESS, min_scale)."))


class LengthSurgeGuardSpec(_Strict):
    """Seed 001's cause F, reactive: if mean_response_len / len_window_steps_ago > ratio,
    lr × factor. Only the LR half of the seed's fix is automatic (switching the correction to
    bypass_pg_geo_rs mid-run is not); after a halving the window starts again, so the next one
    needs a new surge measured over a whole window after it."""

    ratio: YamlFloat = Field(1.2, gt=1.0, le=100.0, description=(
        "Surge threshold: length now / length window_steps ago (seed 001: 1.20)."))
    window_steps: YamlInt = Field(100, ge=1, le=1_000_000, description=(
        "Trainer steps back the length is compared with (seed 001: 100)."))
    factor: YamlFloat = Field(0.5, gt=0.0, lt=1.0, description=(
        "LR multiplier per surge (seed 001: 0.5, a halving)."))
    max_halvings: YamlOptInt = Field(None, ge=1, le=1_000, description=(
        "Stop after this many (None = no limit; seed 001: a surge that persists after the LR "
        "decay points upstream, at the reward)."))


class OptimSpec(_Strict):
    """Optimizer (AdamW) and PPO schedule."""

    lr: YamlFloat = Field(3e-5, gt=0.0, le=1.0, description=(
        "Peak learning rate (3e-5 keeps the embedded warm start stable at 8 prompts × 8; 2e-4 "
        "lowered its eval accuracy within 20 steps)."))
    weight_decay: YamlFloat = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    grad_clip: YamlOptFloat = Field(1.0, gt=0.0, description="Gradient-norm clip (None = off).")
    lr_schedule: Literal["constant", "linear_warmup", "cosine"] = Field(
        "constant", description="Learning-rate schedule over the run's optimizer steps.")
    warmup_steps: YamlInt = Field(0, ge=0, le=10_000_000, description=(
        "Linear warm-up optimizer steps."))
    epochs: YamlInt = Field(1, ge=1, le=64, description=(
        "PPO epochs over each trainer step's batch."))
    micro_batch_size: YamlOptInt = Field(None, ge=1, le=1_000_000, description=(
        "Sequences per forward/backward (gradient accumulation; None = whole mini-batch)."))
    vcpo: VCPOSpec | None = Field(None, description=(
        "VCPO's ESS-guided step size (seed 001): each trainer step's learning rate × the "
        "normalised ESS of its IS weights (null = off); logged as guard/vcpo_lr_scale."))
    length_surge_guard: LengthSurgeGuardSpec | None = Field(None, description=(
        "Cause F's reactive fix (seed 001): halve the learning rate when the mean response "
        "length exceeds ratio × its value window_steps ago (null = off); logged as "
        "guard/lr_halvings and a log line."))


class EvalSpec(_Strict):
    """Held-out evaluation on the rollout engines (greedy), per difficulty bucket."""

    every: YamlInt = Field(10, ge=0, le=1_000_000, description=(
        "Evaluate every N trainer steps (0 = only at the end; the start and the end are always "
        "evaluated when n > 0)."))
    n: YamlInt = Field(64, ge=0, le=100_000, description="Eval prompts (0 = no eval).")


class Recipe(_Strict):
    """One training run (see the module docstring for the sections)."""

    name: str = Field("recipe", min_length=1, max_length=200, description=(
        "A label; it names the run directory ($ASYNCRL_HOME/runs/<name>-<time>), so it is 1-3 "
        "parts joined by '/' (a campaign names its candidates <campaign>/<stage>/<candidate>), "
        "each 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit."))
    description: str = Field("", description="Free text (not part of the hash).")
    # < 2**31: the engines seed numpy with seed + engine index (SGLang --random-seed; numpy
    # takes seeds below 2**32) and torch with seed (below 2**64)
    seed: YamlInt = Field(0, ge=0, le=2**31 - 1, description=(
        "Seeds the task split, prompt order and sampling (0 to 2**31 - 1)."))
    steps: YamlInt = Field(20, ge=1, le=1_000_000, description="Trainer steps (global steps).")
    model: ModelSpec = Field(default_factory=WarmStartModel, description=(
        "Initial weights, by kind: warmstart (embedded, dense or MoE) or checkpoint (HF dir)."))
    engines: EnginesConfig = Field(default_factory=EnginesConfig, description=(
        "Rollout and train backends, rollout server count and numerics."))
    task: TaskConfig = Field(default_factory=TaskConfig, description=(
        "The verifiable task, its arguments and the training difficulty mix."))
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description=(
        "Sampling: group size, prompts per mini-batch, temperature, response cap."))
    async_: AsyncSpec = Field(default_factory=SyncMode, alias="async", description=(
        "Pipeline mode, by mode: sync, one_step or fully_async, with its staleness knobs."))
    data: DataConfig = Field(default_factory=DataConfig, description=(
        "Sample-buffer drain policy and dispatch order."))
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description=(
        "Advantage, policy loss, old log-probs, IS/RS correction, masking, routing replay, KL."))
    optim: OptimSpec = Field(default_factory=OptimSpec, description=(
        "AdamW settings, LR schedule and PPO epochs."))
    eval: EvalSpec = Field(default_factory=EvalSpec, description=(
        "Held-out greedy evaluation cadence and size."))

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              populate_by_name=True, allow_inf_nan=False)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _RECIPE_NAME.fullmatch(v):
            raise ValueError(f"{short_repr(v)} must be 1-3 parts joined by '/', each {_NAME_RULE} "
                             "(it names the run directory)")
        return v

    @model_validator(mode="after")
    def _cross(self) -> Recipe:
        if self.algorithm.routing_replay not in ("none", "auto") and self.moe_experts == 0:
            raise ValueError(f"algorithm.routing_replay={self.algorithm.routing_replay} needs an "
                             "MoE model: set model.moe_experts > 0 or routing_replay: none")
        a = self.async_
        least = a.least_staleness
        if a.max_off_policy_steps is not None and a.max_off_policy_steps < least:
            raise ValueError(
                f"async.max_off_policy_steps={a.max_off_policy_steps} would drop samples the "
                f"{a.mode} mode always produces (staleness up to {least}); set it >= {least}")
        e = self.engines
        if e.rollout == "sglang" and e.sglang.router == "sglang-router" \
                and self.routing_replay == "r3":
            raise ValueError("engines.sglang.router=sglang-router drops return_routed_experts, so "
                             "routing_replay r3 cannot work through it; use router: asyncrl")
        if e.rollout == "sglang" and e.sglang.weight_sync == "nccl" and e.train != "megatron":
            raise ValueError("engines.sglang.weight_sync=nccl broadcasts from the Megatron ranks; "
                             "set engines.train: megatron or weight_sync: disk")
        m, experts = e.megatron, self.moe_experts  # experts None: a checkpoint not known here
        moe = bool(experts)
        if e.train == "megatron" and m.expert_parallel > 1:
            if experts == 0:
                raise ValueError(f"engines.megatron.expert_parallel={m.expert_parallel} needs an "
                                 "MoE model: set model.moe_experts > 0 or expert_parallel: 1")
            if m.data_parallel % m.expert_parallel:
                raise ValueError(
                    f"engines.megatron.expert_parallel={m.expert_parallel} must divide "
                    f"data_parallel={m.data_parallel} (experts are split over the "
                    "data-parallel ranks)")
            if experts and experts % m.expert_parallel:
                raise ValueError(
                    f"engines.megatron.expert_parallel={m.expert_parallel} must divide "
                    f"model.moe_experts={experts}")
        if e.train == "megatron" and isinstance(self.model, WarmStartModel) \
                and self.model.num_layers % m.pipeline_parallel:
            raise ValueError(f"engines.megatron.pipeline_parallel={m.pipeline_parallel} must "
                             f"divide model.num_layers={self.model.num_layers} (every stage "
                             "holds the same number of layers)")
        if e.train == "megatron" and moe and m.tensor_parallel > 1:
            raise ValueError(f"engines.megatron.tensor_parallel={m.tensor_parallel} with an MoE "
                             "model: megatron trains MoE layers under TP only with sequence "
                             "parallelism, which asyncrl does not run; split the experts with "
                             "expert_parallel (and data_parallel) and keep tensor_parallel: 1")
        if self.algorithm.effective_old_logprob == "interrupt":
            why = self._interrupt_refused()
            if why is not None:
                raise ValueError(why)
        if self.algorithm.old_logprob == "dedicated" and e.train != "embedded":
            raise ValueError(f"old_logprob: dedicated keeps its model copy beside the embedded "
                             f"trainer only, not engines.train: {e.train}; use old_logprob: "
                             "snapshot")
        if self.data.max_in_flight < self.rollout.n:
            raise ValueError(f"data.max_in_flight={self.data.max_in_flight} is below the group "
                             f"size rollout.n={self.rollout.n}; raise it")
        return self

    def _interrupt_refused(self) -> str | None:
        """Why ``old_logprob: interrupt`` cannot run with the rest of the recipe (one line with
        the fix), or None."""
        e = self.engines
        if e.train != "embedded":  # (also rules out weight_sync nccl, which needs megatron)
            return (f"old_logprob: interrupt computes π_old with the embedded trainer's forward "
                    f"in the rollouter, not engines.train: {e.train}'s; use old_logprob: "
                    "snapshot")
        if self.routing_replay != "none":
            return (f"old_logprob: interrupt computes π_old with free routing, not routing_replay "
                    f"{self.routing_replay}; set algorithm.routing_replay: none or use "
                    "old_logprob: snapshot")
        a = self.async_
        if isinstance(a, FullyAsyncMode) and a.partial_rollout and a.interrupt == "retract":
            return ("old_logprob: interrupt needs the tokens generated so far back at each "
                    "sync, which async.interrupt retract keeps inside the engine; set "
                    "async.interrupt: abort_resume (or auto)")
        return None

    # --- derived ---------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.async_.mode

    @property
    def partial_interrupt(self) -> Literal["retract", "abort_resume"] | None:
        """How partial rollouts are interrupted at a sync (``async.interrupt`` with ``auto``
        resolved for the rollout backend); None without partial rollout."""
        a = self.async_
        if not isinstance(a, FullyAsyncMode) or not a.partial_rollout:
            return None
        if a.interrupt == "auto":
            return "abort_resume" if self.engines.rollout == "sglang" \
                or self.algorithm.effective_old_logprob == "interrupt" else "retract"
        return a.interrupt

    @property
    def drain(self) -> Literal["submission", "fifo", "windowed_fifo"]:
        """The buffer's drain order: submission order in the lockstep modes (batch N is the N-th
        submitted), ``data.drain`` when streaming."""
        return "submission" if self.async_.submission_order else self.data.drain

    @property
    def groups_per_step(self) -> int:
        return self.rollout.batch_prompts * self.async_.require_batches

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.rollout.n

    @property
    def updates_per_batch(self) -> int:
        """Optimizer updates on each trainer step's batch: async.require_batches × optim.epochs."""
        return self.async_.require_batches * self.optim.epochs

    @property
    def off_policiness(self) -> int:
        """Seed 004's N for routing replay: the policy updates a sample's data spans, from the
        weights that generated it to the last update made on it — updates_per_batch in sync
        mode (the seed's global batch / mini-batch), × (1 + the expected staleness in trainer
        steps) when the pipeline is asynchronous (one_step doubles it)."""
        return max(1, round(self.updates_per_batch * (1 + self.async_.ewma_window)))

    @property
    def routing_replay(self) -> Literal["none", "r2", "r3"]:
        """``algorithm.routing_replay`` with ``auto`` resolved (seed 004, "R2 vs R3 depends on
        off-policiness"): N = 1 none (replay only adds bias on-policy), N = 2-3 r2, N ≥ 4 r3;
        none for a model not known to be MoE. Everything downstream asks this."""
        chosen = self.algorithm.routing_replay
        if chosen != "auto":
            return chosen
        if not self.is_moe:
            return "none"
        n = self.off_policiness
        return "none" if n <= 1 else "r2" if n < 4 else "r3"

    @property
    def is_moe(self) -> bool:
        """True when the model is known to be MoE (a checkpoint of unknown kind: False)."""
        return bool(self.moe_experts)

    @property
    def moe_experts(self) -> int | None:
        """Experts per layer of the model (0 = dense; None: a checkpoint not known here)."""
        return self.model.moe_experts

    def to_dict(self) -> dict[str, Any]:
        """Plain data, the YAML layout (``async`` key)."""
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def hash(self) -> str:
        """:func:`training.recipe_identity.recipe_hash`."""
        return recipe_hash(self)

    def with_overrides(self, overrides: Mapping[str, Any], source: str | None = None) -> Recipe:
        """This recipe with ``overrides`` (dotted keys or nested mappings, merged as
        :func:`apply_overrides` merges) applied and validated; a problem is a
        :class:`RecipeError` naming ``source`` (default: the recipe's name)."""
        return recipe_from_dict(apply_overrides(self.to_dict(), overrides),
                                source or self.name)


_SCHEMA_HINT = "asyncrl schema recipe lists them"  # where an unknown field's message points


def recipe_from_dict(data: Mapping[str, Any], source: str = "recipe") -> Recipe:
    """Validate plain data → :class:`Recipe`; errors → :class:`RecipeError` (one line)."""
    data = require_mapping(data, f"{source}: a recipe is a mapping of sections (model, rollout, "
                           "async, ...)", RecipeError)
    try:
        return Recipe.model_validate(dict(data))
    except ValidationError as err:
        raise RecipeError(format_validation_error(err, source, _SCHEMA_HINT,
                                                  error_unions())) from None


def load_recipe(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Read and validate a recipe YAML file; ``overrides`` are dotted keys (``optim.lr``) or
    nested mappings applied before validation. An empty file is an error, not the defaults."""
    p = Path(path)
    data = read_yaml(p, "recipe", "pass the path of a YAML recipe (see recipes/)", RecipeError)
    data = require_mapping(data, f"{p}: a recipe is a mapping of sections (model, rollout, "
                           "async, ...)", RecipeError)
    if overrides:
        data = apply_overrides(data, overrides)
    return recipe_from_dict(data, str(p))


def _plain(value: Any, what: str) -> Any:
    """A copy of ``value`` with the keys JSON would give it (strings); RecipeError otherwise."""
    try:
        return plain_copy(value, str_keys=True)
    except PlainDataError as err:
        raise RecipeError(f"{what}: {err}") from None


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``overrides`` into a copy of ``data``. Keys may be dotted (``async.mode``).
    A mapping merges into a mapping (or fills a missing or null one); any other value replaces.

    Variants are the schema's own discriminated unions (:func:`variant_unions`: ``model.kind``,
    ``async.mode``, ``algorithm.correction.kind``); a ``mode`` or ``kind`` key anywhere else
    (``algorithm.kl.mode``) is an ordinary field and merges like one. Switching a variant with a
    mapping (``async: {mode: sync}``) starts from the new variant: the mapping is all of it, the
    rest are the new variant's defaults. Switching only the tag with a dotted key
    (``async.mode: one_step``) keeps the old variant's fields that the new variant also has and
    drops the others. A mapping that names another preset (``algorithm.correction: {name: ...}``)
    drops the old preset's ``args`` (the new mapping's own args, if any, are the new preset's).

    Both are copied by :func:`training.yamlfile.plain_copy` first (integer keys become strings,
    as they would through JSON): anything but plain data, a cycle, or more data than an alias
    bomb should expand to is a one-line :class:`RecipeError`, and neither input is changed. So is
    a mapping given where an earlier value is a scalar (``algorithm: 5`` in a stage, then a
    candidate's ``algorithm: {...}``): merging would hide the bad value instead of reporting it."""
    unions = variant_unions()
    out = _plain(dict(data), "recipe")
    for key, value in _plain(dict(overrides), "overrides").items():
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            node = _section(node, part, ".".join(parts[:i + 1]))
        last, parent = parts[-1], ".".join(parts[:-1])
        union = unions.get(parent)
        if (union is not None and last == union[0] and node.get(last) is not None
                and isinstance(value, str) and value != node[last] and value in union[1]):
            # a dotted tag switch: keep what the new variant also accepts
            accepted = union[1][value]
            for k in [k for k in node if k != last and k not in accepted]:
                del node[k]
            node[last] = value
        elif isinstance(value, dict) and node.get(last) is not None:
            node[last] = _merge(_section(node, last, key), value, key, unions)
        else:
            node[last] = value
    return out


@functools.cache
def variant_unions() -> dict[str, tuple[str, dict[str, frozenset[str]]]]:
    """The recipe's discriminated unions, read from the schema: dotted path (YAML spelling) →
    (tag field, {tag value: the field names that variant accepts})."""
    out: dict[str, tuple[str, dict[str, frozenset[str]]]] = {}

    def fields(model: type[BaseModel]) -> frozenset[str]:
        return frozenset(f.alias or n for n, f in model.model_fields.items())

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            path = prefix + (f.alias or name)
            members = [a for a in typing.get_args(f.annotation) or (f.annotation,)
                       if isinstance(a, type) and issubclass(a, BaseModel)]
            if isinstance(f.discriminator, str):
                tag = f.discriminator
                out[path] = (tag, {typing.get_args(m.model_fields[tag].annotation)[0]: fields(m)
                                   for m in members})
            for m in members:
                walk(m, path + ".")

    walk(Recipe, "")
    return out


@functools.cache
def error_unions() -> UnionTags:
    """:func:`variant_unions` as error messages need them: the field holding a union (its last
    path component; pydantic puts the tag in an error's location, ``async.fully_async.x``, and
    users write ``async.x``) → (tag key, its tags)."""
    return {path.rsplit(".", 1)[-1]: (tag, tuple(variants))
            for path, (tag, variants) in variant_unions().items()}


def _section(node: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    """``node[key]``, a mapping (created when missing or null) that an override merges into."""
    if node.get(key) is None:
        node[key] = {}
    elif not isinstance(node[key], dict):
        raise RecipeError(f"overrides: {escape_controls(path)} is {describe(node[key])} (in the "
                          "recipe or an earlier override), so a mapping cannot be merged into "
                          "it; make it a mapping")
    return node[key]


def _merge(base: dict[str, Any], new: dict[str, Any], path: str,
           unions: Mapping[str, tuple[str, dict[str, frozenset[str]]]]) -> dict[str, Any]:
    """``new`` merged into ``base`` (at dotted ``path``); both are fresh plain copies owned by the
    caller."""
    union = unions.get(path)
    if union is not None and union[0] in new and base.get(union[0]) != new[union[0]]:
        return new  # switching variant: start from the new one
    out = dict(base)
    if base.get("kind") == "preset" and "name" in new and new["name"] != base.get("name"):
        # another preset takes other constructor args: the old preset's must not merge into
        # the new one's (a prescription's preset would be refused for the old preset's args)
        out.pop("args", None)
    for k, v in new.items():
        if isinstance(v, dict) and out.get(k) is not None:
            out[k] = _merge(_section(out, k, f"{path}.{k}"), v, f"{path}.{k}", unions)
        else:
            out[k] = v
    return out


def recipe_json_schema() -> dict[str, Any]:
    """JSON schema of the recipe YAML (for editors: yaml-language-server ``$schema``)."""
    schema = Recipe.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "asyncrl recipe"
    return schema
