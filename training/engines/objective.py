"""The policy objective of one train step, shared by every train backend.

A backend supplies the model forward (response log-probs and entropy of some rows, with or without
gradient) and the optimizer; this module supplies everything in between, so the embedded and the
Megatron engines compute *the same* loss, gradient accumulation and metrics from the same code:

* :func:`response_log_probs` — per-token log-probs, entropy and Σ_v π_v² of the response tokens
  from a forward's logits (the sampled token under ``softmax(logits / temperature)``, fp32);
* :func:`micro_batch_log_probs` — the micro-batch loop of ``compute_log_probs`` (log-probs,
  entropy, Σ_v π_v² and routes of every row, gathered into one :class:`LogProbResult`);
* :func:`check_train_inputs` and :class:`PolicyObjective` — the policy loss of
  :mod:`training.algorithms.policy_loss` (with IS weights, the optional entropy bonus and the
  optional KL-to-reference loss term of :func:`training.algorithms.kl.kl_loss_term`) on the rows
  of one micro-batch;
* :func:`accumulate_gradients` — the micro-batch loop of ``train_step`` with both accumulation modes
  of :mod:`training.engines.train` (``scaled``: each micro-batch's loss times its share of the
  global normaliser; ``full_batch``: the loss on the full batch with one micro-batch's rows carrying
  the gradient). A data-parallel backend passes ``owned`` so each rank runs its own micro-batches;
  summing the ranks' gradients then gives the single-process gradient;
* :func:`merge_loss_metrics` and :func:`step_metrics` — the ``policy/*`` and ``train/*`` metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from training.algorithms.kl import kl_loss_term
from training.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig, agg_loss
from training.engines.train import (
    LogProbResult,
    StepConfig,
    TokenBatch,
    loss_agg_mode_for,
    micro_batch_slices,
    micro_batch_weights,
)

__all__ = [
    "Accumulated",
    "PolicyObjective",
    "ResponseLogProbs",
    "accumulate_gradients",
    "check_train_inputs",
    "log_probs_per_token_version",
    "merge_loss_metrics",
    "micro_batch_log_probs",
    "response_log_probs",
    "step_metrics",
]

# forward(rows, grad) -> (log_probs (b, T), entropy (b, T)) of batch.select(rows)
ForwardFn = Callable[[slice, bool], tuple[torch.Tensor, torch.Tensor]]
# forward(rows) -> (log_probs (b, T), entropy (b, T) or None, Σ_v π_v² (b, T) or None,
#                   per-sequence routes or None)
LogProbForwardFn = Callable[
    [slice], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                   Sequence[torch.Tensor] | None]]


class ResponseLogProbs(NamedTuple):
    """What :func:`response_log_probs` returns: (b, T) fp32 tensors, 0 where j ≥ O_b."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    sum_pi_squared: torch.Tensor | None


def response_log_probs(logits: torch.Tensor, batch: TokenBatch, temperature: float,
                       with_entropy: bool, with_sum_pi_squared: bool = False
                       ) -> ResponseLogProbs:
    """Log-probs, entropy and Σ_v π_v² of ``batch``'s response tokens from its forward's logits.

    Args:
        logits: (b, S', V) logits of the b rows of ``batch`` for positions 0..S'−1 (S' ≥ the
            longest sequence; the batch may be trimmed to it).
        batch: the rows that were forwarded.
        temperature: the rollout's sampling temperature (> 0).
        with_entropy: also compute the entropy.
        with_sum_pi_squared: also compute Σ_v softmax(z)_v² per position (the ``Σπ²`` of verl's
            score-norm proxy W = Σ_t [1 − 2 π_t(y_t) + Σ_v π_v²]); detached, from the softmax
            the entropy uses.
    Returns:
        :class:`ResponseLogProbs` (log_probs, entropy or None, sum_pi_squared or None).
    """
    device = logits.device
    valid = batch.valid_response_mask.to(device)
    # response token j of row b sits at P_b + j and is predicted at position P_b + j − 1
    pos = batch.prompt_lens[:, None] - 1 + torch.arange(batch.response_len)[None, :]
    pos = torch.where(batch.valid_response_mask, pos, torch.zeros_like(pos)).to(device)
    picked = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    z = picked.float() / temperature  # (b, T, V): the rollout engine's logits / T
    log_probs_all = torch.log_softmax(z, dim=-1)
    targets = batch.responses.to(device)
    lp = log_probs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    entropy = sum_sq = None
    probs = torch.softmax(z, dim=-1) if with_entropy or with_sum_pi_squared else None
    if with_entropy:
        # H = logsumexp(z) − Σ_v softmax(z)_v z_v  (finite even where a probability underflows)
        ent = torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)
        entropy = torch.where(valid, ent, torch.zeros_like(ent))
    if with_sum_pi_squared:
        p = probs.detach()
        sq = (p * p).sum(-1)
        sum_sq = torch.where(valid, sq, torch.zeros_like(sq))
    return ResponseLogProbs(lp, entropy, sum_sq)


def log_probs_per_token_version(compute: Callable[..., LogProbResult], batch: TokenBatch,
                                versions: torch.Tensor, **kwargs) -> LogProbResult:
    """Each response token under the version that generated it (seed 003: partial rollouts span
    updates): one ``compute(rows, version=v, **kwargs)`` per distinct version over the rows that
    use it.

    Args:
        compute: the engine's ``compute_log_probs``.
        batch: B sequences.
        versions: (B, T) weight version of each response token.
        kwargs: routing, temperature, with_entropy, r2_version, micro_batch_size.
    """
    shape = (batch.batch_size, batch.response_len)
    if tuple(versions.shape) != shape:
        raise ValueError(f"per-token versions must be (B, T) = {shape}, got "
                         f"{tuple(versions.shape)}")
    with_entropy = bool(kwargs.get("with_entropy", True))
    valid = batch.valid_response_mask
    versions = torch.where(valid, versions.to(torch.long), torch.zeros(shape, dtype=torch.long))
    lp = torch.zeros(shape)
    ent = torch.zeros(shape) if with_entropy else None
    sum_sq: torch.Tensor | None = torch.zeros(shape) if with_entropy else None
    for v in sorted(set(versions[valid].tolist())):
        hit = valid & (versions == v)
        rows = hit.any(dim=1).nonzero().reshape(-1)
        res = compute(batch.select(rows), version=int(v), **kwargs)
        sel = hit[rows]
        lp[rows] = torch.where(sel, res.log_probs, lp[rows])
        if ent is not None and res.entropy is not None:
            ent[rows] = torch.where(sel, res.entropy, ent[rows])
        if sum_sq is not None:
            if res.sum_pi_squared is None:
                sum_sq = None
            else:
                sum_sq[rows] = torch.where(sel, res.sum_pi_squared, sum_sq[rows])
    return LogProbResult(log_probs=lp, entropy=ent, routes=None, weight_version=None,
                         token_versions=versions, sum_pi_squared=sum_sq)


def micro_batch_log_probs(forward: LogProbForwardFn, batch: TokenBatch, *,
                          micro_batch_size: int | None, with_entropy: bool, is_moe: bool,
                          weight_version: int | None) -> LogProbResult:
    """Run ``forward`` over the micro-batches of ``batch`` and gather one result.

    Args:
        forward: ``forward(rows)`` → log-probs (b, T), entropy (b, T) or None, Σ_v π_v² (b, T)
            or None, and the per-sequence routes (or None) of ``batch.select(rows)``; the
            caller sets the grad mode and the model's train / eval mode.
        batch: B sequences.
        micro_batch_size: rows per forward (None = all).
        with_entropy: whether the result carries entropy (and Σ_v π_v² when every forward
            returned it).
        is_moe: whether the result carries routes (a tuple, possibly empty) or None.
        weight_version: the result's ``weight_version``.
    Returns:
        :class:`LogProbResult` with CPU (B, T) log-probs (and entropy).
    """
    lps, ents, sqs, routes = [], [], [], []
    all_sq = True
    for s in micro_batch_slices(batch.batch_size, micro_batch_size):
        lp, ent, sq, r = forward(s)
        lps.append(lp.cpu())
        if ent is not None:
            ents.append(ent.cpu())
        if sq is None:
            all_sq = False
        else:
            sqs.append(sq.cpu())
        if r is not None:
            routes.extend(r)
    t = batch.response_len
    return LogProbResult(
        log_probs=torch.cat(lps) if lps else torch.zeros(0, t),
        entropy=(torch.cat(ents) if ents else torch.zeros(0, t)) if with_entropy else None,
        routes=tuple(routes) if is_moe else None,
        weight_version=weight_version,
        sum_pi_squared=(torch.cat(sqs) if sqs else torch.zeros(0, t))
        if with_entropy and all_sq else None,
    )


def check_train_inputs(batch: TokenBatch, advantages: torch.Tensor, old_log_prob: torch.Tensor,
                       rollout_is_weights: torch.Tensor | None,
                       ref_log_prob: torch.Tensor | None = None, lr_scale: float = 1.0) -> None:
    """ValueError naming the fix unless the step's tensors are (B, T) and ``lr_scale`` is a
    finite number > 0 (the settings were checked when their :class:`StepConfig` was built)."""
    if not (math.isfinite(lr_scale) and lr_scale > 0):
        raise ValueError(f"lr_scale must be a finite number > 0, got {lr_scale}")
    shape = (batch.batch_size, batch.response_len)
    named = {"advantages": advantages, "old_log_prob": old_log_prob}
    if rollout_is_weights is not None:
        named["rollout_is_weights"] = rollout_is_weights
    if ref_log_prob is not None:
        named["ref_log_prob"] = ref_log_prob
    for name, tensor in named.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; it must be (B, T) = "
                             f"{shape} like batch.response_mask")


@dataclass
class PolicyObjective:
    """The registered policy loss on (B, T) tensors already on the backend's device, minus
    ``entropy_coeff · agg(entropy)``, plus ``kl_coef · agg(KL term)`` when the step config asks
    for a KL loss term (same aggregation mode as the loss). The KL term's ratio is π_θ/π_old with
    π_old = ``old_log_prob`` and its ε the loss's ``clip_ratio_low/high``."""

    loss_fn: Callable
    config: PolicyLossConfig
    agg_mode: str
    mask: torch.Tensor
    advantages: torch.Tensor
    old_log_prob: torch.Tensor
    rollout_is_weights: torch.Tensor | None
    entropy_coeff: float
    ref_log_prob: torch.Tensor | None = None
    kl_estimator: str | None = None
    kl_coef: float = 0.0
    kl_is_correction: str = "none"

    @classmethod
    def build(cls, batch: TokenBatch, advantages: torch.Tensor, old_log_prob: torch.Tensor,
              rollout_is_weights: torch.Tensor | None, config: StepConfig, *,
              device: torch.device, ref_log_prob: torch.Tensor | None = None
              ) -> PolicyObjective:
        """The objective of one step: ``config``'s loss, loss settings, entropy bonus and KL loss
        term on the step's (B, T) tensors, moved to ``device``."""
        if config.kl_estimator is not None and ref_log_prob is None:
            raise ValueError(f"the step config adds a KL loss term (kl_estimator="
                             f"{config.kl_estimator!r}); pass ref_log_prob (B, T), the reference "
                             "policy's log-probs of the batch")
        loss_fn = POLICY_LOSSES.get(config.loss_name)
        cfg = config.loss_config or PolicyLossConfig()
        return cls(
            loss_fn=loss_fn, config=cfg, agg_mode=loss_agg_mode_for(config.loss_name, cfg),
            mask=batch.response_mask.to(device),
            advantages=advantages.detach().to(device, torch.float32),
            old_log_prob=old_log_prob.detach().to(device, torch.float32),
            rollout_is_weights=(None if rollout_is_weights is None
                                else rollout_is_weights.detach().to(device)),
            entropy_coeff=config.entropy_coeff,
            ref_log_prob=(None if config.kl_estimator is None or ref_log_prob is None
                          else ref_log_prob.detach().to(device, torch.float32)),
            kl_estimator=config.kl_estimator, kl_coef=config.kl_coef,
            kl_is_correction=config.kl_is_correction)

    def __call__(self, lp: torch.Tensor, ent: torch.Tensor, rows: slice | None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(loss, policy loss, the loss's metrics) of ``rows`` (None = the whole batch)."""
        m = self.mask if rows is None else self.mask[rows]
        pick = (lambda x: x) if rows is None else (lambda x: x[rows])
        isw = self.rollout_is_weights
        pg, metrics = self.loss_fn(pick(self.old_log_prob), lp, pick(self.advantages), m,
                                   self.config, None if isw is None else pick(isw))
        loss = pg
        if self.entropy_coeff:
            loss = loss - self.entropy_coeff * agg_loss(ent, m, self.agg_mode,
                                                        self.config.loss_scale_factor)
        if self.ref_log_prob is not None and self.kl_estimator is not None:
            cfg = self.config
            low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
            high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
            term, kl_metrics = kl_loss_term(
                lp, pick(self.old_log_prob), pick(self.ref_log_prob), m, self.kl_estimator,
                self.kl_is_correction, clip_ratio_low=low, clip_ratio_high=high,
                rollout_is_weights=None if isw is None else pick(isw))
            kl = agg_loss(term, m, self.agg_mode, cfg.loss_scale_factor)
            loss = loss + self.kl_coef * kl
            metrics = {**metrics, **kl_metrics, "policy/kl_loss": float(kl.detach()),
                       "policy/kl_coef": self.kl_coef}
        return loss, pg, metrics


@dataclass
class Accumulated:
    """What :func:`accumulate_gradients` leaves besides the gradients (this process's share)."""

    loss: float = 0.0
    """Σ_m w_m · loss_m over the micro-batches run here (full_batch: the full-batch loss)."""
    pg_loss: float = 0.0
    """The same for the policy loss alone."""
    parts: list[tuple[dict[str, float], float]] = field(default_factory=list)
    """(loss metrics, weight) per micro-batch run here."""
    entropies: torch.Tensor | None = None
    """(B, T) entropy of the rows forwarded here (zeros elsewhere; full_batch: every row)."""
    micro_batches: int = 0
    """Number of micro-batches of the step (all processes)."""


def accumulate_gradients(batch: TokenBatch, objective: PolicyObjective, forward: ForwardFn, *,
                         config: StepConfig, device: torch.device,
                         owned: Callable[[int], bool] | None = None) -> Accumulated:
    """Backward the step's loss micro-batch by micro-batch (see the module docstring).

    Args:
        batch: the global batch.
        objective: its :class:`PolicyObjective`.
        forward: ``forward(rows, grad)`` → (log-probs, entropy) of ``batch.select(rows)``.
        config: the step's settings; reads ``micro_batch_size`` (rows per forward, None = all)
            and ``accumulation`` (``scaled`` or ``full_batch``).
        device: where the backend's tensors live.
        owned: ``owned(i)`` is True for the micro-batches (by index) this process backwards;
            None = all of them. Rows without loss tokens are never forwarded.
    """
    shape = (batch.batch_size, batch.response_len)
    mask = objective.mask
    slices = micro_batch_slices(batch.batch_size, config.micro_batch_size)
    mine = [owned is None or owned(i) for i in range(len(slices))]
    active = [s for s in slices if bool(mask[s].any())]  # rows without loss tokens: no grad
    acc = Accumulated(entropies=torch.zeros(shape, device=device), micro_batches=len(slices))
    entropies = acc.entropies
    if config.accumulation == "scaled":
        weights = micro_batch_weights(batch.response_mask, slices, objective.agg_mode)
        for s, w, run_here in zip(slices, weights, mine, strict=True):
            if s not in active or not run_here:
                continue
            lp, ent = forward(s, True)
            loss, pg, m = objective(lp, ent, s)
            (loss * w).backward()
            acc.loss += w * float(loss.detach())
            acc.pg_loss += w * float(pg.detach())
            acc.parts.append((m, w))
            entropies[s] = ent.detach()
    else:
        # exact for any loss: evaluate the loss on the full batch with micro-batch m's rows
        # carrying the gradient and the other rows detached (same values, computed first)
        full_lp = torch.zeros(shape, device=device)
        for s in active:
            lp, ent = forward(s, False)
            full_lp[s], entropies[s] = lp, ent
        for s, run_here in zip(slices, mine, strict=True):
            if s not in active or not run_here:
                continue
            lp, ent = forward(s, True)
            rows = torch.arange(batch.batch_size, device=device)[s]
            loss, pg, m = objective(full_lp.index_copy(0, rows, lp),
                                    entropies.index_copy(0, rows, ent), None)
            loss.backward()
            acc.loss, acc.pg_loss = float(loss.detach()), float(pg.detach())
            acc.parts = [(m, 1.0)]
    return acc


def merge_loss_metrics(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Combine per-micro-batch loss metrics: ``*/max`` → max, ``*/min`` → min, else the mean
    weighted by the micro-batch loss weights (exact for means; quantiles are approximate)."""
    if not parts:
        return {}
    total_w = sum(w for _, w in parts)
    out: dict[str, float] = {}
    for key in parts[0][0]:
        values = [(m[key], w) for m, w in parts if key in m]
        if key.endswith("/max"):
            out[key] = max(v for v, _ in values)
        elif key.endswith("/min"):
            out[key] = min(v for v, _ in values)
        elif total_w > 0:
            out[key] = sum(v * w for v, w in values) / total_w
        else:
            out[key] = sum(v for v, _ in values) / len(values)
    return out


def step_metrics(batch: TokenBatch, *, loss: float, pg_loss: float, entropies: torch.Tensor,
                 mask: torch.Tensor, grad_norm: float, lr: float, skipped: bool,
                 weight_version: int, step: int, micro_batches: int,
                 elapsed: float) -> dict[str, float]:
    """The ``train/*`` metrics of one train step (see ``TrainEngine.train_step``)."""
    ent_mean = float(entropies[mask].mean()) if bool(mask.any()) else 0.0
    return {
        "train/loss": loss,
        "train/pg_loss": pg_loss,
        "train/entropy": ent_mean,
        "train/grad_norm": grad_norm,
        "train/lr": lr,
        "train/skipped_step": float(skipped),
        "train/weight_version": float(weight_version),
        "train/step": float(step),
        "train/num_sequences": float(batch.batch_size),
        "train/num_tokens": float(batch.num_tokens),
        "train/num_loss_tokens": float(batch.num_loss_tokens),
        "train/micro_batches": float(micro_batches),
        "train/step_time_s": elapsed,
        "train/tokens_per_s": batch.num_tokens / elapsed if elapsed > 0 else 0.0,
    }
