"""The embedded train engine: an fp32 :class:`~training.engines.model.CausalLM` trained with torch.

Implements :class:`training.engines.train.TrainEngine` (read that module's docstring first: batch
layout, routing modes R2/R3, micro-batch aggregation). This module adds what is specific to the
embedded backend:

* **Weights and versions.** fp32 weights on ``device`` (CPU by default). The version starts at the
  loaded checkpoint's ``weight_version`` (0 for fresh weights) and increases by 1 per *applied*
  optimizer step; a step whose gradient norm or loss is not finite is skipped (no update, no new
  version, ``train/skipped_step = 1``).
* **Snapshots** (seed 003, "snapshot-based version tracking"): right before an optimizer step
  overwrites version v, a CPU copy of v is retained, so exact old log-probs of v stay computable
  after the update (also per token, for partial rollouts spanning versions). Retained copies live
  under a byte budget; the oldest versions are evicted first; asking for an evicted version raises
  :class:`~training.engines.train.SnapshotUnavailableError` naming the retained versions.
  :meth:`EmbeddedTrainEngine.compute_log_probs_with_weights` runs parameters that are no version at
  all (the revised PPO-EWMA reference of seed 003) on the same frozen shadow model.
* **R2 routes.** Every free-routing forward of an MoE model remembers the experts it chose, keyed by
  (token content, version), in a bounded FIFO cache; R2 replays them, or records them under the
  retained snapshot of ``r2_version`` when they are not cached.
* **Optimizer.** AdamW (decay on matrices and embeddings, none on norm weights), global-norm
  gradient clipping, the learning rate set before each step from
  :func:`~training.engines.train.lr_multiplier` (the schedule's state is the step counter) times
  the step's ``lr_scale`` (the learner's reactive guards; their state is the learner's, not in
  this engine's checkpoint).
* **Checkpoints.** A checkpoint directory *is* an HF model directory (``save_hf_dir``: loadable by
  the rollout server and by ``transformers``) plus ``trainer_state.pt`` (optimizer state, step,
  version, optimizer config, RNG states of torch / numpy / python), the retained snapshots
  (``snapshots/v<N>.safetensors``) and the R2 route cache (``r2_routes.safetensors``). Written
  atomically. Resuming is exact: the next step after :meth:`load_checkpoint` computes bitwise the
  same loss and weights as an uninterrupted run (tested on CPU). A path that is missing, empty, not
  a trainer checkpoint or unreadable raises :class:`~training.engines.hf_io.CheckpointError` and
  leaves the engine unchanged — never a silent start from random weights (seed 000, stage 1).
"""

from __future__ import annotations

import math
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from training.engines.hf_io import (
    CheckpointError,
    check_hf_dir,
    load_hf_dir,
    load_weights_into,
    move_into_place,
    read_model_config,
    read_state_dict,
    save_hf_dir,
)
from training.engines.model import CausalLM, ModelConfig
from training.engines.objective import (
    PolicyObjective,
    accumulate_gradients,
    check_train_inputs,
    log_probs_per_token_version,
    merge_loss_metrics,
    micro_batch_log_probs,
    response_log_probs,
    step_metrics,
)
from training.engines.retained import (
    TRAINER_STATE_FILE,
    RetainedState,
    SnapshotStore,
    Weights,
    optim_config_state,
    optim_from_state,
    read_routes,
    read_weights,
    rng_state,
    set_rng_state,
)
from training.engines.routes import RouteCache, RouteReplay, pad_routes
from training.engines.train import (
    DEFAULT_STEP_CONFIG,
    LogProbResult,
    OptimConfig,
    StepConfig,
    TokenBatch,
    check_temperature,
    lr_multiplier,
)
from training.tasks.tokenizer import CharTokenizer

__all__ = [
    "DEFAULT_SNAPSHOT_BUDGET_BYTES",
    "TRAINER_STATE_FILE",
    "EmbeddedTrainEngine",
    "RetainedState",
    "RouteCache",
    "SnapshotStore",
]

DEFAULT_SNAPSHOT_BUDGET_BYTES = 256 * 2**20
DEFAULT_ROUTE_CACHE_SEQUENCES = 50_000
SNAPSHOT_DIR = "snapshots"
ROUTE_CACHE_FILE = "r2_routes.safetensors"
STATE_FORMAT = 1



# ------------------------------------------------------------------------------------------------
# Engine
# ------------------------------------------------------------------------------------------------


class EmbeddedTrainEngine(RetainedState, RouteReplay):
    """fp32 torch trainer of the embedded model (see the module docstring).

    Build with :meth:`from_pretrained` (warm start from an HF directory), :meth:`from_checkpoint`
    (exact resume) or :meth:`from_config` (explicit random initialisation).
    """

    def __init__(
        self,
        model: CausalLM,
        tokenizer: CharTokenizer | None = None,
        *,
        optim: OptimConfig | None = None,
        weight_version: int = 0,
        snapshot_budget_bytes: int = DEFAULT_SNAPSHOT_BUDGET_BYTES,
        route_cache_sequences: int = DEFAULT_ROUTE_CACHE_SEQUENCES,
        device: str | torch.device = "cpu",
    ) -> None:
        """
        Args:
            model: the model to train (moved to fp32 on ``device``).
            tokenizer: saved with every export / checkpoint (default :class:`CharTokenizer`).
            optim: optimizer and schedule settings.
            weight_version: version of ``model``'s current weights.
            snapshot_budget_bytes: CPU memory for retained old versions (0 disables them).
            route_cache_sequences: how many (version, sequence) route records R2 keeps.
            device: torch device of the live weights (snapshots always stay on CPU).
        """
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=torch.float32)
        self.tokenizer = tokenizer or CharTokenizer()
        if self.tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} ids but the model's "
                             f"vocab_size is {model.config.vocab_size}")
        self.optim = optim or OptimConfig()
        self._version = int(weight_version)
        self._step = 0
        self._snapshots = SnapshotStore(snapshot_budget_bytes)
        self._routes = RouteCache(route_cache_sequences)
        self._shadow: CausalLM | None = None
        self._shadow_version: int | None = None
        self._optimizer = self._build_optimizer(self.optim)

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | Path, **kwargs: Any) -> EmbeddedTrainEngine:
        """Warm start from an HF directory (weights, tokenizer, ``weight_version``); a fresh
        optimizer. Missing / empty / unreadable → :class:`CheckpointError`."""
        loaded = load_hf_dir(directory, dtype=torch.float32)
        return cls(loaded.model, loaded.tokenizer, weight_version=loaded.weight_version, **kwargs)

    @classmethod
    def from_config(cls, config: ModelConfig, *, seed: int = 0,
                    tokenizer: CharTokenizer | None = None, **kwargs: Any) -> EmbeddedTrainEngine:
        """Random initialisation (``CausalLM.init_weights(seed)``), asked for explicitly."""
        return cls(CausalLM(config).init_weights(seed), tokenizer, **kwargs)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, **kwargs: Any) -> EmbeddedTrainEngine:
        """Exact resume from a :meth:`save_checkpoint` directory (any failure →
        :class:`CheckpointError`; no engine is returned with random weights). The checkpoint's
        OptimConfig replaces ``optim`` if one is passed (resuming is exact); ``kwargs`` set the
        snapshot budget, route cache and device."""
        d = _check_trainer_dir(directory)
        engine = cls(_blank_model(read_model_config(d)), **kwargs)
        engine.load_checkpoint(d)
        return engine

    def _build_optimizer(self, cfg: OptimConfig) -> torch.optim.AdamW:
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)

    # --- state --------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def step(self) -> int:
        return self._step

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    # snapshot_versions / snapshot_info / drop_snapshots / close: RetainedState

    def _current_weights_cpu(self) -> Weights:
        # named_parameters() lists a tied LM head once, under model.embed_tokens.weight — the same
        # names state_dict_for_export writes, so a snapshot exports as-is.
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def _model_at(self, version: int) -> CausalLM:
        """The live model for the current version, else a shadow loaded with the snapshot."""
        if version > self._version:
            raise ValueError(f"weight version {version} does not exist yet (current "
                             f"{self._version})")
        if version == self._version:
            return self.model
        weights = self._snapshots.get(version)
        shadow = self._shadow_model()
        if self._shadow_version != version:
            with torch.no_grad():
                for name, p in shadow.named_parameters():
                    p.copy_(weights[name])
            self._shadow_version = version
        return shadow

    def _shadow_model(self) -> CausalLM:
        """The frozen second model that runs weights other than the live ones (built once)."""
        if self._shadow is None:
            self._shadow = _blank_model(self.model.config).to(self.device)
            self._shadow.requires_grad_(False)
        return self._shadow

    # --- forward ------------------------------------------------------------------------------
    def _forward(
        self, model: CausalLM, batch: TokenBatch, replay: Sequence[torch.Tensor] | None,
        temperature: float, with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        """Response log-probs (b, T), entropy (b, T) and per-sequence routes of ``batch``."""
        lp, entropy, _, routes = self._forward_stats(model, batch, replay, temperature,
                                                     with_entropy)
        return lp, entropy, routes

    def _forward_stats(
        self, model: CausalLM, batch: TokenBatch, replay: Sequence[torch.Tensor] | None,
        temperature: float, with_entropy: bool, with_sum_pi_squared: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
               tuple[torch.Tensor, ...] | None]:
        """Response log-probs (b, T), entropy (b, T), Σ_v π_v² (b, T) (``with_sum_pi_squared``)
        and per-sequence routes of ``batch``.

        The input is trimmed to the batch's longest sequence; outputs keep the full width T.
        """
        width = max(int(batch.total_lens.max()), 1)
        ids = batch.input_ids[:, :width].to(self.device)
        attn = batch.attention_mask[:, :width].to(self.device)
        replay_t = None if replay is None else pad_routes(batch, replay, width,
                                                          self.model.config).to(self.device)
        logits, routes = model(ids, attention_mask=attn, replay_routes=replay_t)
        lp, entropy, sum_sq = response_log_probs(logits, batch, temperature, with_entropy,
                                                 with_sum_pi_squared)
        per_seq = None
        if routes is not None:
            per_seq = tuple(routes[i, : int(batch.total_lens[i]) - 1].to("cpu", torch.int32)
                            for i in range(batch.batch_size))
        return lp, entropy, sum_sq, per_seq

    # --- routing (shared: training.engines.routes.RouteReplay) -------------------------------
    def _route_config(self) -> ModelConfig:
        return self.model.config

    # --- log-probs ----------------------------------------------------------------------------
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
        """See :meth:`training.engines.train.TrainEngine.compute_log_probs`."""
        check_temperature(temperature)
        if isinstance(version, torch.Tensor):
            return self._log_probs_per_token_version(batch, version, routing, temperature,
                                                     with_entropy, r2_version, micro_batch_size)
        v = self._version if version is None else int(version)
        # routes first: recording R2 routes of another version may load its snapshot into the
        # shadow model that version v's snapshot is then loaded into
        replay = self._replay_for(batch, routing, v, r2_version)
        model = self._model_at(v)
        with torch.no_grad():
            result = micro_batch_log_probs(
                lambda s: self._forward_stats(model, batch.select(s),
                                              None if replay is None else replay[s],
                                              temperature, with_entropy,
                                              with_sum_pi_squared=with_entropy),
                batch, micro_batch_size=micro_batch_size, with_entropy=with_entropy,
                is_moe=self.model.config.is_moe, weight_version=v)
        if result.routes and replay is None:
            self._remember_routes(batch, v, result.routes)
        return result

    def compute_log_probs_with_weights(
        self,
        batch: TokenBatch,
        weights: Mapping[str, torch.Tensor],
        *,
        routing: str = "free",
        temperature: float = 1.0,
        with_entropy: bool = False,
        r2_version: int | None = None,
        micro_batch_size: int | None = None,
    ) -> LogProbResult:
        """Log-probs of ``batch`` under arbitrary parameters ``weights``, no gradient.

        For references that are no trainer version, e.g. the revised PPO-EWMA average of seed 003
        (§5.2). ``weights`` maps every name of ``model.named_parameters()`` to a tensor of the same
        shape (a snapshot-style CPU dict). They are loaded into the shadow model; the live weights,
        retained snapshots and R2 route cache are untouched, and routes chosen here are not
        remembered (the weights have no version).

        Args:
            batch: B sequences.
            weights: name → tensor, exactly the model's parameter names and shapes.
            routing: ``free`` (the router of ``weights`` decides), ``r3`` (``batch.routes``) or
                ``r2`` (the trainer's own routes under ``r2_version``, which is required).
            temperature: sampling temperature of the rollout.
            with_entropy: also return the per-token entropy.
            r2_version: reference version of R2 routes.
            micro_batch_size: rows per forward (None = all).
        Returns:
            :class:`LogProbResult` with (B, T) log-probs, ``weight_version=None``.
        """
        check_temperature(temperature)
        self._check_weights(weights)
        if routing == "r2" and r2_version is None:
            raise ValueError("routing='r2' with explicit weights needs r2_version (the version "
                             "whose routes to replay): the weights themselves are no version")
        # routes first: recording R2 routes may load a snapshot into the shadow model
        replay = self._replay_for(batch, routing, -1, r2_version)
        shadow = self._shadow_model()
        with torch.no_grad():
            for name, p in shadow.named_parameters():
                p.copy_(weights[name])
        self._shadow_version = None  # the shadow now holds no version
        with torch.no_grad():
            return micro_batch_log_probs(
                lambda s: self._forward_stats(shadow, batch.select(s),
                                              None if replay is None else replay[s],
                                              temperature, with_entropy,
                                              with_sum_pi_squared=with_entropy),
                batch, micro_batch_size=micro_batch_size, with_entropy=with_entropy,
                is_moe=self.model.config.is_moe, weight_version=None)

    def _check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """ValueError unless ``weights`` has exactly the model's parameter names and shapes."""
        params = dict(self.model.named_parameters())
        missing, extra = set(params) - set(weights), set(weights) - set(params)
        if missing or extra:
            raise ValueError(f"weights do not match the model's parameters (missing "
                             f"{sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}); pass a "
                             "dict keyed like model.named_parameters()")
        for name, p in params.items():
            if tuple(weights[name].shape) != tuple(p.shape):
                raise ValueError(f"weights[{name!r}] has shape {tuple(weights[name].shape)}, the "
                                 f"model's parameter has {tuple(p.shape)}")

    def load_version(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Make ``weights`` the live weights, as ``version`` (newer than the current one); the
        previous live weights are retained as a snapshot within the budget. How a frozen copy
        follows another trainer's versions (the dedicated old-logit model, seed 003 §5.1); no
        optimizer step is taken and the R2 route cache is untouched."""
        if int(version) <= self._version:
            raise ValueError(f"load_version: version {version} is not newer than the current "
                             f"{self._version}")
        self._check_weights(weights)
        if self._snapshots.budget_bytes > 0:
            self._snapshots.put(self._version, self._current_weights_cpu())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(weights[name])
        self._version = int(version)

    def parameter_bytes(self) -> int:
        """Bytes of every parameter copy this engine holds: the live model, the retained
        snapshots and, once built, the shadow model that runs them."""
        live = sum(p.numel() * p.element_size() for p in self.model.parameters())
        shadow = 0 if self._shadow is None else live
        return live + shadow + self._snapshots.nbytes

    def _log_probs_per_token_version(
        self, batch: TokenBatch, versions: torch.Tensor, routing: str, temperature: float,
        with_entropy: bool, r2_version: int | None, micro_batch_size: int | None,
    ) -> LogProbResult:
        """Each response token under the version that generated it (seed 003: partial rollouts
        span updates). One forward per distinct version over the rows that use it."""
        return log_probs_per_token_version(
            self.compute_log_probs, batch, versions, routing=routing, temperature=temperature,
            with_entropy=with_entropy, r2_version=r2_version, micro_batch_size=micro_batch_size)

    # --- training -----------------------------------------------------------------------------
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
        """One optimizer step: see :meth:`training.engines.train.TrainEngine.train_step`.

        ``config.entropy_coeff`` > 0 subtracts ``coeff · agg(entropy)`` (same aggregation mode
        as the loss) from the loss. Metrics: ``train/loss`` (total), ``train/pg_loss``,
        ``train/entropy`` (token-mean over the response mask), ``train/grad_norm`` (global L2,
        before clipping), ``train/lr``, ``train/skipped_step``, ``train/weight_version`` (after
        the step), ``train/step``, token counts, ``train/step_time_s``, ``train/tokens_per_s``
        (real prompt + response tokens per second) and the loss's ``policy/*`` metrics.
        """
        t0 = time.perf_counter()
        check_train_inputs(batch, advantages, old_log_prob, rollout_is_weights, ref_log_prob,
                           lr_scale)
        dev = self.device
        objective = PolicyObjective.build(batch, advantages, old_log_prob, rollout_is_weights,
                                          config, device=dev, ref_log_prob=ref_log_prob)
        version = self._version
        replay = self._replay_for(batch, config.routing, version, r2_version)
        record = replay is None and self.model.config.is_moe

        def forward(s: slice, grad: bool):
            with torch.set_grad_enabled(grad):
                mb = batch.select(s)
                lp, ent, routes = self._forward(self.model, mb, None if replay is None
                                                else replay[s], config.temperature,
                                                with_entropy=True)
            if record and routes is not None:
                self._remember_routes(mb, version, routes)
            return lp, ent

        self.model.train()
        self._optimizer.zero_grad(set_to_none=True)
        acc = accumulate_gradients(batch, objective, forward, config=config, device=dev)
        metrics = merge_loss_metrics(acc.parts)
        grad_norm = self._clip_gradients()
        lr = self.optim.lr * lr_multiplier(self.optim, self._step) * lr_scale
        skipped = not (math.isfinite(grad_norm) and math.isfinite(acc.loss))
        if not skipped:
            if self._snapshots.budget_bytes > 0:
                self._snapshots.put(version, self._current_weights_cpu())
            for group in self._optimizer.param_groups:
                group["lr"] = lr
            self._optimizer.step()
            self._step += 1
            self._version += 1
        self._optimizer.zero_grad(set_to_none=True)
        metrics.update(step_metrics(
            batch, loss=acc.loss, pg_loss=acc.pg_loss, entropies=acc.entropies,
            mask=objective.mask, grad_norm=grad_norm, lr=lr, skipped=skipped,
            weight_version=self._version, step=self._step, micro_batches=acc.micro_batches,
            elapsed=time.perf_counter() - t0))
        return metrics

    def _clip_gradients(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        if self.optim.grad_clip is None:
            return float(torch.nn.utils.get_total_norm(grads))
        return float(torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.grad is not None], self.optim.grad_clip))

    # --- export / checkpoints -----------------------------------------------------------------
    def export_weights(self, directory: str | Path, *, version: int | None = None,
                       meta: dict[str, Any] | None = None) -> int:
        """HF directory of the current weights (or of a retained ``version``); returns the
        version written to ``asyncrl.json`` (what the rollout engine will report)."""
        v = self._version if version is None else int(version)
        info = {"source": "asyncrl.embedded_trainer", "trainer_step": self._step, **(meta or {})}
        if v == self._version:
            save_hf_dir(directory, self.model, self.tokenizer, weight_version=v, meta=info)
        else:
            if v > self._version:
                raise ValueError(f"weight version {v} does not exist yet (current "
                                 f"{self._version})")
            save_hf_dir(directory, self.model, self.tokenizer, weight_version=v, meta=info,
                        state_dict=self._snapshots.get(v))
        return v

    def save_checkpoint(self, directory: str | Path, *, include_snapshots: bool = True) -> Path:
        """Write an exact-resume checkpoint atomically (see the module docstring).

        ``include_snapshots=False`` skips the retained old versions (smaller; old log-probs of
        those versions are then unavailable after resuming).
        """
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.ckpt-{uuid.uuid4().hex[:8]}"
        try:
            save_hf_dir(tmp, self.model, self.tokenizer, weight_version=self._version,
                        meta={"source": "asyncrl.embedded_trainer", "kind": "trainer_checkpoint",
                              "trainer_step": self._step})
            snaps = self._snapshots.items() if include_snapshots else []
            if snaps:
                (tmp / SNAPSHOT_DIR).mkdir()
                for v, weights in snaps:
                    save_file(weights, str(tmp / SNAPSHOT_DIR / f"v{v}.safetensors"))
            if len(self._routes):
                save_file(self._routes.tensors(), str(tmp / ROUTE_CACHE_FILE))
            state = {
                "format": STATE_FORMAT,
                "step": self._step,
                "weight_version": self._version,
                "optim_config": optim_config_state(self.optim),
                "optimizer": self._optimizer.state_dict(),
                "snapshot_versions": [v for v, _ in snaps],
                "rng": rng_state(),
            }
            torch.save(state, tmp / TRAINER_STATE_FILE)
            move_into_place(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore a :meth:`save_checkpoint` directory exactly (weights, optimizer, schedule
        step, version, RNG, snapshots, R2 routes). Everything is read and validated before the
        engine changes; any problem raises :class:`CheckpointError` naming the fix."""
        d = _check_trainer_dir(directory)
        state = _read_trainer_state(d)
        cfg = read_model_config(d)
        if cfg != self.model.config:
            raise CheckpointError(f"checkpoint {d} holds a different architecture ({cfg}) than "
                                  f"this engine ({self.model.config}); build the engine with "
                                  "EmbeddedTrainEngine.from_checkpoint")
        weights = read_state_dict(d)
        optim = optim_from_state(state, d)
        snapshots = [(int(v), read_weights(d / SNAPSHOT_DIR / f"v{int(v)}.safetensors"))
                     for v in state["snapshot_versions"]]
        routes = read_routes(d / ROUTE_CACHE_FILE)
        try:
            tokenizer = CharTokenizer.load(d)
        except (FileNotFoundError, OSError, ValueError) as e:
            raise CheckpointError(f"tokenizer of {d} is unreadable ({e}); re-save the "
                                  "checkpoint") from None
        try:  # a new optimizer over the same parameters: loading its state touches no weight
            optimizer = self._build_optimizer(optim)
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{d / TRAINER_STATE_FILE}: optimizer state does not fit the "
                                  f"model ({e}); the checkpoint is corrupt or from another "
                                  "model") from None
        # commit
        load_weights_into(self.model, weights, source=d)
        self.optim, self._optimizer, self.tokenizer = optim, optimizer, tokenizer
        self._step, self._version = int(state["step"]), int(state["weight_version"])
        self._restore_retained(snapshots, routes)
        set_rng_state(state["rng"])


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _blank_model(cfg: ModelConfig) -> CausalLM:
    """A model whose weights are about to be overwritten, built without consuming the global
    torch RNG (so creating it never changes what a resumed run draws)."""
    with torch.random.fork_rng(devices=[]):
        return CausalLM(cfg)


def _check_trainer_dir(directory: str | Path) -> Path:
    d = check_hf_dir(directory)
    if not (d / TRAINER_STATE_FILE).is_file():
        raise CheckpointError(f"{d} is a model directory but not a trainer checkpoint (no "
                              f"{TRAINER_STATE_FILE}); to warm start from its weights use "
                              "EmbeddedTrainEngine.from_pretrained")
    return d


_STATE_KEYS = ("format", "step", "weight_version", "optim_config", "optimizer",
               "snapshot_versions", "rng")


def _read_trainer_state(d: Path) -> dict[str, Any]:
    path = d / TRAINER_STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated / garbage files
        # (torch's own text suggests weights_only=False, which would be wrong advice here)
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}); the checkpoint is "
                              "corrupt or truncated — resume from an earlier one") from None
    if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS):
        raise CheckpointError(f"{path} lacks trainer fields {list(_STATE_KEYS)}; it was not "
                              "written by EmbeddedTrainEngine.save_checkpoint")
    if state["format"] != STATE_FORMAT:
        raise CheckpointError(f"{path} has format {state['format']}, this asyncrl reads "
                              f"{STATE_FORMAT}")
    return state
