"""The train-engine protocol: what an RL loop asks of a trainer, for every backend.

Backends: ``embedded`` (fp32 torch on CPU, :mod:`training.engines.embedded.trainer`) and, later,
``megatron`` (megatron-core, Ray actors per rank). Everything that crosses this boundary is plain
CPU tensors, ints, floats and paths, so a backend living in other processes can implement it.

Notation. A batch holds B sequences; sequence b is a prompt of P_b token ids (starting with <bos>)
followed by a response of O_b token ids (ending with <eos> unless cut at max_new_tokens). Packed:

* ``input_ids`` (B, S): prompt + response, right-padded, S ≥ max_b (P_b + O_b);
* ``response_mask`` (B, T): which response tokens count in the loss, T ≥ max_b O_b, response token
  j of sequence b is ``input_ids[b, P_b + j]`` and is predicted by the logits at position
  ``P_b + j − 1``. The mask may exclude tokens (e.g. tool outputs) but never covers j ≥ O_b.

Log-probs are of the given (sampled) token under ``softmax(logits / temperature)`` computed in
fp32, the distribution the rollout engine samples from after temperature. Top-p / top-k truncation
is *not* applied by a trainer: the policy being optimised is the full-vocabulary distribution; a
rollout that truncated shows the difference as engine mismatch.

Routing (MoE; seed 004 "Correction: Routing Replay"). ``routes`` use SGLang's layout: for a
sequence with P + O tokens an int array (P + O − 1, L, k) of the experts chosen at every position
whose next token the model computed (positions 0 .. P+O−2). Modes:

* ``free``: the trainer's router decides (its choices are returned, and remembered for R2).
* ``r2`` (vanilla Routing Replay): replay the *trainer's own* routes recorded under a reference
  version ``r2_version`` (θ_old of the global step: ``e^π_old``). ``r2_version=None`` means "the
  weights this call runs with", i.e. the routes of the first forward of this step, which is free
  routing — so the first mini-batch of a global step optimises the unaltered target policy and later
  mini-batches (``r2_version`` = the version the global step started from) replay those routes.
  Routes come from a cache filled by every free forward (keyed by token content + version) or, if
  absent, are recorded by a no-grad forward under the retained snapshot of ``r2_version``.
* ``r3`` (Rollout Routing Replay): replay the routes the rollout engine returned (``batch.routes``).

Replayed experts fix *which* experts run; their mixing weights still come from the router's
softmax, so the router keeps its gradient.

Micro-batching (``StepConfig.micro_batch_size``): the gradient is that of the *global* batch
loss, whatever the split. Default ``accumulation="scaled"``: micro-batch m's loss, aggregated by the
loss's own ``loss_agg_mode`` over its rows, is multiplied by :func:`micro_batch_weights` before
``backward`` — its share of the global normaliser (valid tokens for ``token-mean``, non-empty
sequences for the ``seq-mean-*`` modes; T is kept equal across micro-batches so Dr.GRPO's constant
is shared). Σ_m w_m · L_m then equals the global loss for every loss whose aggregate is a sum of
per-token or per-sequence terms. ``accumulation="full_batch"`` is exact for every loss, including
those with batch statistics (clip_cov, kl_cov, bypass_mode's rejection/normalisation): a no-grad
pass computes all log-probs, then micro-batch m's rows (with gradient) replace their detached copies
in the full (B, T) tensor and the loss is evaluated on the full batch (one extra forward).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from training.algorithms.kl import KL_IS_CORRECTIONS, resolve_kl_estimator
from training.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig
from training.engines.hf_io import CheckpointError

__all__ = [
    "ACCUMULATION_MODES",
    "DEFAULT_STEP_CONFIG",
    "LR_SCHEDULES",
    "ROUTING_MODES",
    "SEQUENCE_OBJECTIVE_LOSSES",
    "CheckpointError",
    "LogProbResult",
    "OptimConfig",
    "SnapshotUnavailableError",
    "StepConfig",
    "TokenBatch",
    "TrainEngine",
    "check_temperature",
    "loss_agg_mode_for",
    "lr_multiplier",
    "micro_batch_slices",
    "micro_batch_weights",
    "sequence_key",
]

ROUTING_MODES: tuple[str, ...] = ("free", "r2", "r3")
LR_SCHEDULES: tuple[str, ...] = ("constant", "linear_warmup", "cosine")
ACCUMULATION_MODES: tuple[str, ...] = ("scaled", "full_batch")

# Losses of training.algorithms.policy_loss that aggregate with `sequence_objective_agg_mode`
# (their paper objective is a per-sequence mean); every other loss uses `loss_agg_mode`.
SEQUENCE_OBJECTIVE_LOSSES: frozenset[str] = frozenset(
    {"gspo", "gspo_token", "sapo", "gmpo", "geo_mean"}
)


class SnapshotUnavailableError(LookupError):
    """Log-probs were asked under a weight version the engine does not hold (evicted or never
    retained); the message names the retained versions and the fix."""


# ------------------------------------------------------------------------------------------------
# Batch
# ------------------------------------------------------------------------------------------------


def _as_long_1d(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(list(values) if not isinstance(values, torch.Tensor) else values,
                           dtype=torch.long).reshape(-1)


def _as_routes(r: object) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(r) if not isinstance(r, torch.Tensor) else r)
    return t.to(torch.int32)


@dataclass(frozen=True)
class TokenBatch:
    """B sequences (prompt + response) packed right-padded; all tensors on CPU.

    Build with :meth:`from_sequences`; slice with :meth:`select` / :meth:`split`.
    """

    input_ids: torch.Tensor
    """(B, S) long: prompt then response ids, right-padded with the pad id."""
    attention_mask: torch.Tensor
    """(B, S) bool: True on the P_b + O_b real tokens."""
    prompt_lens: torch.Tensor
    """(B,) long: P_b ≥ 1 (the prompt starts with <bos>)."""
    response_lens: torch.Tensor
    """(B,) long: O_b ≥ 0."""
    response_mask: torch.Tensor
    """(B, T) bool: response tokens that count in the loss (subset of j < O_b)."""
    routes: tuple[torch.Tensor | None, ...] | None = None
    """Per sequence int32 (P_b + O_b − 1, L, k) rollout routes for R3, or None (dense / none)."""

    def __post_init__(self) -> None:
        for name in ("attention_mask", "response_mask"):  # accept 0/1 masks, store bool
            value = getattr(self, name)
            if value.dtype != torch.bool:
                object.__setattr__(self, name, value != 0)
        b, s = self.input_ids.shape if self.input_ids.dim() == 2 else (-1, -1)
        if b < 0:
            raise ValueError(f"input_ids must be (B, S), got {tuple(self.input_ids.shape)}")
        if self.attention_mask.shape != (b, s):
            raise ValueError(f"attention_mask {tuple(self.attention_mask.shape)} must be {(b, s)}")
        if self.prompt_lens.shape != (b,) or self.response_lens.shape != (b,):
            raise ValueError("prompt_lens and response_lens must be (B,)")
        if self.response_mask.dim() != 2 or self.response_mask.shape[0] != b:
            raise ValueError(f"response_mask must be (B={b}, T), got "
                             f"{tuple(self.response_mask.shape)}")
        if b and int(self.prompt_lens.min()) < 1:
            raise ValueError("every prompt needs at least one token (<bos>)")
        if b and int(self.response_lens.min()) < 0:
            raise ValueError("response lengths must be >= 0")
        if b and int((self.prompt_lens + self.response_lens).max()) > s:
            raise ValueError("a sequence is longer than input_ids' width S")
        if b and int(self.response_lens.max()) > self.response_len:
            raise ValueError("a response is longer than response_mask's width T")
        if bool((self.response_mask & ~self.valid_response_mask).any()):
            raise ValueError("response_mask covers positions j >= O_b (past a response's end)")
        if self.routes is not None and len(self.routes) != b:
            raise ValueError(f"routes has {len(self.routes)} entries for {b} sequences")

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_sequences(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        *,
        pad_token_id: int = 0,
        routes: Sequence[object | None] | None = None,
        loss_masks: Sequence[Sequence[int | bool]] | None = None,
        response_len: int | None = None,
    ) -> TokenBatch:
        """Pack lists of token ids.

        Args:
            prompts: B prompts (each ≥ 1 id, starting with <bos>).
            responses: B responses (may be empty).
            pad_token_id: fill value of the padding.
            routes: B route arrays (P_b + O_b − 1, L, k) (numpy, tensor or nested lists), or None
                entries; for R3.
            loss_masks: B lists of O_b 0/1 flags (1 = the token counts); default all ones.
            response_len: force the width T (≥ the longest response), e.g. to keep T fixed.
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        b = len(prompts)
        lens_p = [len(p) for p in prompts]
        lens_o = [len(r) for r in responses]
        s = max((p + o for p, o in zip(lens_p, lens_o, strict=True)), default=1)
        t = max(lens_o, default=0)
        if response_len is not None:
            if response_len < t:
                raise ValueError(f"response_len={response_len} < longest response {t}")
            t = response_len
        ids = torch.full((b, s), pad_token_id, dtype=torch.long)
        attn = torch.zeros(b, s, dtype=torch.bool)
        mask = torch.zeros(b, t, dtype=torch.bool)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            seq = list(p) + list(r)
            ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            attn[i, : len(seq)] = True
            if loss_masks is None:
                mask[i, : len(r)] = True
            else:
                flags = list(loss_masks[i])
                if len(flags) != len(r):
                    raise ValueError(f"loss_masks[{i}] has {len(flags)} flags for a response of "
                                     f"{len(r)} tokens")
                mask[i, : len(r)] = torch.as_tensor(flags, dtype=torch.bool)
        packed_routes = None
        if routes is not None:
            if len(routes) != b:
                raise ValueError(f"routes has {len(routes)} entries for {b} sequences")
            packed_routes = tuple(None if r is None else _as_routes(r) for r in routes)
        return cls(ids, attn, _as_long_1d(lens_p), _as_long_1d(lens_o), mask, packed_routes)

    # --- views ------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        """S, the packed width."""
        return int(self.input_ids.shape[1])

    @property
    def response_len(self) -> int:
        """T, the response width."""
        return int(self.response_mask.shape[1])

    @property
    def total_lens(self) -> torch.Tensor:
        """(B,) P_b + O_b."""
        return self.prompt_lens + self.response_lens

    @property
    def valid_response_mask(self) -> torch.Tensor:
        """(B, T) bool: j < O_b (every real response token, whatever the loss mask says)."""
        return torch.arange(self.response_len)[None, :] < self.response_lens[:, None]

    @property
    def response_positions(self) -> torch.Tensor:
        """(B, T) long: position in S of response token j (P_b + j); 0 where j ≥ O_b."""
        pos = self.prompt_lens[:, None] + torch.arange(self.response_len)[None, :]
        return torch.where(self.valid_response_mask, pos, torch.zeros_like(pos))

    @property
    def responses(self) -> torch.Tensor:
        """(B, T) long response ids, 0 where j ≥ O_b."""
        ids = self.input_ids.gather(1, self.response_positions.clamp(max=self.seq_len - 1))
        return torch.where(self.valid_response_mask, ids, torch.zeros_like(ids))

    @property
    def num_tokens(self) -> int:
        """Real tokens Σ_b (P_b + O_b)."""
        return int(self.total_lens.sum())

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that count in the loss (response_mask.sum())."""
        return int(self.response_mask.sum())

    def sequence(self, i: int) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) of sequence i."""
        p, o = int(self.prompt_lens[i]), int(self.response_lens[i])
        row = self.input_ids[i].tolist()
        return row[:p], row[p : p + o]

    def select(self, rows: Sequence[int] | torch.Tensor | slice) -> TokenBatch:
        """The sub-batch of ``rows`` with the same widths S and T."""
        idx = (torch.arange(self.batch_size)[rows] if isinstance(rows, slice)
               else _as_long_1d(rows))
        routes = None if self.routes is None else tuple(self.routes[int(i)] for i in idx)
        return TokenBatch(self.input_ids[idx], self.attention_mask[idx], self.prompt_lens[idx],
                          self.response_lens[idx], self.response_mask[idx], routes)

    def split(self, micro_batch_size: int) -> list[TokenBatch]:
        """Consecutive sub-batches of ≤ ``micro_batch_size`` rows (same S and T)."""
        return [self.select(s) for s in micro_batch_slices(self.batch_size, micro_batch_size)]


def sequence_key(batch: TokenBatch, i: int) -> str:
    """Content key of sequence i (hash of its P + O token ids): names its routes in R2 caches."""
    n = int(batch.total_lens[i])
    data = batch.input_ids[i, :n].to(torch.int64).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------


@dataclass
class LogProbResult:
    """What :meth:`TrainEngine.compute_log_probs` returns (CPU tensors)."""

    log_probs: torch.Tensor
    """(B, T) fp32 log π(y_j) under softmax(logits / temperature); 0 where j ≥ O_b."""
    entropy: torch.Tensor | None
    """(B, T) fp32 entropy of that distribution at each response position (None if not asked)."""
    routes: tuple[torch.Tensor | None, ...] | None
    """Per sequence int32 (P_b + O_b − 1, L, k): the experts used (recorded or replayed); None for
    a dense model or when per-token versions were asked."""
    weight_version: int | None
    """Version of the weights used; None when per-token versions were asked."""
    token_versions: torch.Tensor | None = None
    """(B, T) long versions used per token when per-token versions were asked, else None."""
    sum_pi_squared: torch.Tensor | None = None
    """(B, T) fp32 Σ_v π_v² of the same distribution at each response position (the Σπ² of verl's
    score-norm proxy W, for ``policy/proxy2_total_power``); computed alongside the entropy by the
    engines that share :func:`training.engines.objective.response_log_probs`, None when entropy
    was not asked or the engine does not provide it. 0 where j ≥ O_b."""


# ------------------------------------------------------------------------------------------------
# Optimiser / schedule
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimConfig:
    """AdamW + gradient clipping + learning-rate schedule (shared by every backend)."""

    lr: float = 1e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam β1, β2."""
    eps: float = 1e-8
    """Adam ε."""
    weight_decay: float = 0.01
    """Decoupled weight decay, applied to matrices and embeddings only (not to norm weights)."""
    grad_clip: float | None = 1.0
    """Max global L2 gradient norm; None disables clipping (the norm is still reported)."""
    lr_schedule: str = "constant"
    """``constant`` | ``linear_warmup`` | ``cosine`` (see :func:`lr_multiplier`)."""
    warmup_steps: int = 0
    """Linear warm-up length in optimizer steps (linear_warmup, cosine)."""
    total_steps: int | None = None
    """Steps over which cosine decays to ``min_lr_ratio · lr`` (required by cosine)."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of ``lr``."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0 or not self.weight_decay >= 0:
            raise ValueError("eps must be > 0 and weight_decay >= 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None (no clipping), got {self.grad_clip}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r}; use one of "
                             f"{', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if self.lr_schedule == "constant" and self.warmup_steps:
            raise ValueError("lr_schedule='constant' has no warm-up; use 'linear_warmup' or "
                             "'cosine' with warmup_steps")
        if self.lr_schedule == "cosine" and (self.total_steps is None
                                             or self.total_steps <= self.warmup_steps):
            raise ValueError("lr_schedule='cosine' needs total_steps > warmup_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("min_lr_ratio must be in [0, 1]")


def lr_multiplier(cfg: OptimConfig, step: int) -> float:
    """Factor on ``cfg.lr`` for the optimizer step with 0-based index ``step``.

    * constant: 1.
    * linear_warmup: ``min(1, (step + 1) / W)`` (the first step already moves: lr / W), then 1.
    * cosine: the same warm-up, then ``r + (1 − r)·½(1 + cos(π·p))`` with
      ``p = (step − W) / (total_steps − W)`` clamped to [0, 1] and r = ``min_lr_ratio``.
    """
    if cfg.lr_schedule == "constant":
        return 1.0
    w = cfg.warmup_steps
    if w and step < w:
        return (step + 1) / w
    if cfg.lr_schedule == "linear_warmup":
        return 1.0
    assert cfg.total_steps is not None
    p = min(max((step - w) / (cfg.total_steps - w), 0.0), 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


# ------------------------------------------------------------------------------------------------
# Train-step settings
# ------------------------------------------------------------------------------------------------


def check_temperature(temperature: float) -> None:
    """ValueError naming the fix unless ``temperature`` is a finite number > 0."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be > 0 (the rollout's sampling temperature), got "
                         f"{temperature}; greedy rollouts have no sampling distribution — score "
                         "them at temperature 1.0")


@dataclass(frozen=True)
class StepConfig:
    """The settings of :meth:`TrainEngine.train_step` that stay the same for a whole run (the
    learner builds one from the recipe); the per-step tensors and versions are arguments.

    Frozen and picklable: the Megatron engine sends it to its rank actors as it is.
    """

    loss_name: str = "vanilla"
    """Registered policy loss (:data:`training.algorithms.policy_loss.POLICY_LOSSES`)."""
    loss_config: PolicyLossConfig | None = None
    """The loss's settings (None = ``PolicyLossConfig()``)."""
    routing: str = "free"
    """``free`` | ``r2`` | ``r3`` (see the module docstring); R2's reference version is the
    per-step ``r2_version`` argument."""
    temperature: float = 1.0
    """The rollout's sampling temperature (> 0): log-probs are of ``softmax(logits / T)``."""
    micro_batch_size: int | None = None
    """Rows per forward/backward (None = the whole batch); the gradient is the global batch's
    whatever the split (see ``accumulation``)."""
    entropy_coeff: float = 0.0
    """Subtracts ``coeff · agg(entropy)`` (the loss's aggregation mode) from the loss."""
    accumulation: str = "scaled"
    """``scaled`` | ``full_batch`` (see the module docstring)."""
    kl_estimator: str | None = None
    """KL-to-reference loss term (``algorithm.kl.mode: in_loss``): the estimator, or None for no
    term. When set, every ``train_step`` needs ``ref_log_prob`` and adds
    ``kl_coef · agg(term)`` (the loss's aggregation mode) with the term of
    :func:`training.algorithms.kl.kl_loss_term`."""
    kl_coef: float = 0.0
    """β of the KL loss term."""
    kl_is_correction: str = "none"
    """The KL loss term's IS correction (:data:`training.algorithms.kl.KL_IS_CORRECTIONS`)."""

    def __post_init__(self) -> None:
        POLICY_LOSSES.get(self.loss_name)  # KeyError listing the registered losses
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"routing={self.routing!r}; use one of {', '.join(ROUTING_MODES)}")
        check_temperature(self.temperature)
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got "
                             f"{self.micro_batch_size}")
        if self.accumulation not in ACCUMULATION_MODES:
            raise ValueError(f"accumulation={self.accumulation!r}; use one of "
                             f"{', '.join(ACCUMULATION_MODES)}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if self.kl_estimator is not None:
            kind = resolve_kl_estimator(self.kl_estimator)  # KeyError listing the estimators
            if self.kl_is_correction not in KL_IS_CORRECTIONS:
                raise ValueError(f"kl_is_correction={self.kl_is_correction!r}; use one of "
                                 f"{', '.join(KL_IS_CORRECTIONS)}")
            if self.kl_is_correction == "deepseek_k3" and kind != "k3":
                raise ValueError(f"kl_is_correction=deepseek_k3 weights the k3 estimator; set "
                                 f"kl_estimator='k3', not {self.kl_estimator!r}")


DEFAULT_STEP_CONFIG = StepConfig()


# ------------------------------------------------------------------------------------------------
# Micro-batch aggregation
# ------------------------------------------------------------------------------------------------


def loss_agg_mode_for(loss_name: str, config: PolicyLossConfig) -> str:
    """The aggregation mode the policy loss ``loss_name`` applies (see policy_loss.agg_loss)."""
    if loss_name in SEQUENCE_OBJECTIVE_LOSSES:
        return config.sequence_objective_agg_mode
    return config.loss_agg_mode


def micro_batch_slices(batch_size: int, micro_batch_size: int | None) -> list[slice]:
    """Consecutive row slices of ≤ ``micro_batch_size`` (None or ≥ B → one slice)."""
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
    size = batch_size if micro_batch_size is None else micro_batch_size
    size = max(size, 1)
    return [slice(i, min(i + size, batch_size)) for i in range(0, batch_size, size)]


def micro_batch_weights(response_mask: torch.Tensor, slices: Sequence[slice],
                        loss_agg_mode: str) -> list[float]:
    """w_m such that Σ_m w_m · agg(ℓ[rows_m]) = agg(ℓ) over the whole batch.

    ``token-mean``: w_m = N_m / N (valid tokens); ``token-sum``: w_m = 1 (a sum of the
    micro-batches' sums); the ``seq-mean-*`` modes: w_m = S_m / S (sequences with ≥ 1 valid
    token). ``seq-mean-token-sum-norm`` divides by the same constant in every micro-batch because
    T is kept. A batch with nothing valid gives zeros.

    Args:
        response_mask: (B, T) mask of the whole batch.
        slices: the micro-batches' row slices.
        loss_agg_mode: the loss's aggregation mode.
    """
    mask = response_mask.bool()
    if loss_agg_mode == "token-sum":
        return [1.0 if mask.any() else 0.0 for _ in slices]
    if loss_agg_mode == "token-mean":
        counts = [int(mask[s].sum()) for s in slices]
    else:
        counts = [int(mask[s].any(dim=-1).sum()) for s in slices]
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


# ------------------------------------------------------------------------------------------------
# Protocol
# ------------------------------------------------------------------------------------------------


@runtime_checkable
class TrainEngine(Protocol):
    """A trainer the RL loop drives: log-probs, policy updates, weight export, checkpoints.

    Versions: an int that starts at the loaded checkpoint's ``weight_version`` (0 for fresh
    weights) and increases by 1 per applied optimizer step.
    """

    @property
    def weight_version(self) -> int:
        """Version of the current weights."""
        ...

    @property
    def step(self) -> int:
        """Optimizer steps applied since the weights were initialised / warm started."""
        ...

    def compute_log_probs(
        self,
        batch: TokenBatch,
        *,
        routing: str = "free",
        version: int | torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = True,
        r2_version: int | None = None,
        micro_batch_size: int | None = None,
    ) -> LogProbResult:
        """Log-probs (and entropy) of ``batch``'s responses, no gradient.

        ``version``: None → current weights; an int → that version (current or a retained
        snapshot; :class:`SnapshotUnavailableError` otherwise); a (B, T) long tensor → each token
        under the version that generated it (partial rollouts spanning updates, seed 003).
        """
        ...

    def train_step(
        self,
        batch: TokenBatch,
        advantages: torch.Tensor,
        old_log_prob: torch.Tensor,
        *,
        rollout_is_weights: torch.Tensor | None = None,
        r2_version: int | None = None,
        config: StepConfig = DEFAULT_STEP_CONFIG,
        ref_log_prob: torch.Tensor | None = None,
        lr_scale: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step on ``batch`` (advantages, old_log_prob, IS weights: (B, T)).

        ``r2_version``: the version whose routes ``routing='r2'`` replays (None = this step's
        own weights); ``config``: the run's loss, routing, temperature, micro-batching, entropy
        bonus, accumulation mode and KL loss term (:class:`StepConfig`); ``ref_log_prob``:
        (B, T) reference log-probs, required when ``config.kl_estimator`` is set;
        ``lr_scale``: factor (> 0) on this step's scheduled learning rate (the learner's reactive
        guards); ``train/lr`` reports the rate applied.

        Returns metrics: ``train/loss``, ``train/grad_norm`` (before clipping), ``train/lr``,
        ``train/entropy``, ``train/weight_version`` … plus the loss's own ``policy/*`` metrics.
        """
        ...

    def export_weights(self, directory: str | Path, *, version: int | None = None) -> int:
        """Write an HF directory of the current (or a retained) version; returns the version."""
        ...

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Everything needed for an exact resume (weights, optimizer, schedule, RNG, versions)."""
        ...

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore a :meth:`save_checkpoint` directory; missing / empty / unreadable →
        :class:`CheckpointError` (never a silent start from random weights)."""
        ...

    def snapshot_versions(self) -> list[int]:
        """Versions whose log-probs can be computed besides the current one (oldest first)."""
        ...

    def close(self) -> None:
        """Release resources (memory, worker processes)."""
        ...

