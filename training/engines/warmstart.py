"""Supervised warm start: teach the task's reference responses so RL starts with reward signal.

Teacher forcing on ``<bos> prompt response <eos>``; the cross-entropy is averaged over the response
tokens including <eos> (the prompt is context only). AdamW (weight decay on matrices only), linear
warm-up then cosine or linear decay to ``min_lr_ratio * lr``, gradient clipping; everything seeded.
The result is an HF directory (:func:`training.engines.hf_io.save_hf_dir`, weight version 0) whose
``asyncrl.json`` records the task, the config, its hash, timings and the per-difficulty eval table.

Cache: the checkpoint is stored under ``cache_dir("warmstart")/<hash>`` where the hash covers the
whole config and the task's description (a JSONL task includes the file's sha256). A second call
with the same config copies the cached directory instead of training, so campaigns reuse it.

MoE: the MoE checkpoint is *upcycled* from the dense one (FACTS.md; "sparse upcycling",
arXiv:2212.05055): attention, norms, embeddings and head are copied; every expert of a layer is a
copy of that layer's dense MLP (Mixtral names: w1 = gate_proj, w3 = up_proj, w2 = down_proj); the
router is N(0, router_std²) noise. Because the top-k mixing weights are renormalised to sum to 1,
identical experts make the MoE block output exactly the dense MLP output whatever the routing — the
upcycled model starts with the dense model's accuracy. Identical experts also make the router's
gradient zero, so a short MoE fine-tune (``moe_finetune_steps``, default 100) lets the experts drift
apart (tokens routed differently give them different gradients) before the router can learn;
``expert_divergence`` measures how far they moved.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from training.engines.evaluate import EvalResult, evaluate
from training.engines.hf_io import check_hf_dir, load_hf_dir, read_meta, save_hf_dir
from training.engines.model import CausalLM, ModelConfig
from training.fileio import replace_dir
from training.paths import cache_dir
from training.tasks.registry import Task, get_task
from training.tasks.tokenizer import CharTokenizer
from training.tasks.tools import ToolTask

# Bump when the training code changes in a way that changes its result: old cache entries are
# then never reused.
CACHE_FORMAT = 1
IGNORE = -100


@dataclass(frozen=True)
class WarmStartConfig:
    """Everything that determines a warm-start checkpoint (its hash is the cache key).

    task / task_args: registered task name and constructor keywords (e.g. ``{"max_k": 8}``,
        ``{"path": "data.jsonl", "reward": "numeric"}``); the task seed is ``seed``.
    seed: seeds the weights, the task split and the batches.
    hidden_size, num_layers, num_heads, intermediate_size, max_position_embeddings: the model
        (defaults: FACTS.md's ~0.8M-parameter, 4-layer, d=128 testbed).
    steps, batch_size: optimisation steps and sequences per step.
    lr, min_lr_ratio, warmup_steps, schedule: peak learning rate, final lr as a fraction of it,
        linear warm-up steps, decay shape after warm-up. Default 2e-3 cosine to 0 (issue 26):
        the earlier 3e-3 to 0.1×lr stopped mid-descent, so micro-batching, a reordered batch or
        the thread count (rounding alone) moved the greedy accuracy 0.56–0.79; 3e-3 to 0 was no
        better (0.46–0.72); 2e-3 to 0 gave 0.80–0.85 (benchmarks/warmstart_robustness.py).
    weight_decay, beta1, beta2, grad_clip: AdamW and gradient-norm clipping.
    difficulty_weights: relative sampling weight of each difficulty in a batch as
        ``((difficulty, weight), ...)``; empty = the task's own balanced mix.
    eval_n, eval_batch_size: examples for the final greedy evaluation and its batch size.
    moe_experts: 0 = dense; else upcycle to this many experts per layer.
    moe_top_k: experts per token of the upcycled model.
    moe_router_std: std of the upcycled router's random weights.
    moe_finetune_steps, moe_finetune_lr: an optional supervised fine-tune of the upcycled model.
    micro_batches: split every batch into this many micro-batches whose gradients are accumulated
        (the loss is weighted by response tokens, so the gradient is the full batch's up to
        rounding). Part of the cache key when not 1.
    order_seed: None = the examples of a batch in the task's order; else each batch is permuted
        with this seed (same examples, another order: the same step up to rounding). Part of the
        cache key when not None.
    threads: torch intra-op threads while training; None = sized to the free cores (see
        :func:`free_cores`: the idle CPUs this process may use, so a warm start beside another
        job does not spin on oversubscribed cores). The previous setting is restored afterwards.
        Never part of the cache key (like the machine, it changes only the rounding).
    micro_batches, order_seed and threads exist so the warm start's robustness to rounding can be
    measured (benchmarks/warmstart_robustness.py): none of them should move the greedy accuracy
    by more than the schedule's noise.
    """

    task: str = "sum_digits"
    task_args: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 344
    max_position_embeddings: int = 256
    steps: int = 700
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.0
    warmup_steps: int = 50
    schedule: Literal["cosine", "linear"] = "cosine"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0
    difficulty_weights: tuple[tuple[int, float], ...] = ()
    eval_n: int = 400
    eval_batch_size: int = 128
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_router_std: float = 0.02
    moe_finetune_steps: int = 100
    moe_finetune_lr: float = 1e-3
    micro_batches: int = 1
    order_seed: int | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.micro_batches < 1 or self.micro_batches > self.batch_size:
            raise ValueError(f"micro_batches must be in [1, batch_size={self.batch_size}]")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be None (auto) or >= 1")
        if self.steps < 0 or self.batch_size < 1 or self.eval_n < 1 or self.eval_batch_size < 1:
            raise ValueError("steps must be >= 0; batch_size, eval_n, eval_batch_size >= 1")
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.warmup_steps < 0:
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0")
        if self.schedule not in ("cosine", "linear"):
            raise ValueError(f"schedule must be 'cosine' or 'linear', got {self.schedule!r}")
        if any(w < 0 for _, w in self.difficulty_weights) or (
                self.difficulty_weights and not any(w > 0 for _, w in self.difficulty_weights)):
            raise ValueError("difficulty_weights must be >= 0 with at least one > 0")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k must be in [1, moe_experts={self.moe_experts}]")
        if self.moe_experts < 0 or self.moe_finetune_steps < 0 or self.moe_router_std < 0:
            raise ValueError("moe_experts, moe_finetune_steps and moe_router_std must be >= 0")

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    def dense(self) -> WarmStartConfig:
        """The dense part of this config (what an MoE warm start upcycles from)."""
        moe_defaults = {f.name: f.default for f in fields(self) if f.name.startswith("moe_")}
        return replace(self, **moe_defaults)

    def build_task(self) -> Task:
        return get_task(self.task, seed=self.seed, **dict(self.task_args))

    def model_config(self, tokenizer: CharTokenizer) -> ModelConfig:
        return ModelConfig(
            vocab_size=tokenizer.vocab_size, hidden_size=self.hidden_size,
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name, neutral in _NEUTRAL.items():  # absent at their neutral value: old keys hold
            if d[name] == neutral:
                del d[name]
        d["task_args"] = {k: str(v) if isinstance(v, Path) else v for k, v in self.task_args}
        d["difficulty_weights"] = {str(k): w for k, w in self.difficulty_weights}
        return d


# Hooks that leave the cache key (and the recorded config) unchanged at these values; ``threads``
# is never hashed (see config_hash).
_NEUTRAL: dict[str, Any] = {"micro_batches": 1, "order_seed": None, "threads": None}


def config_hash(cfg: WarmStartConfig, task: Task) -> str:
    """sha256 (hex, 16 chars) of the config, the task's description and :data:`CACHE_FORMAT`."""
    config = cfg.to_dict()
    config.pop("threads", None)  # an execution resource, like the machine
    blob = json.dumps({"format": CACHE_FORMAT, "config": config, "task": task.describe()},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ProgressEvent:
    """Reported after every optimisation step (``phase`` = "train" or "moe_finetune") and once
    before the final evaluation (``phase`` = "eval", step = total = 0)."""

    phase: str
    step: int
    total: int
    loss: float = math.nan
    lr: float = math.nan


ProgressFn = Callable[[ProgressEvent], None]


@dataclass
class WarmStartResult:
    """path: the checkpoint written; cache_hit: whether training was skipped; meta: its
    ``asyncrl.json`` (config, hash, timings, eval table)."""

    path: Path
    cache_hit: bool
    config_hash: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def eval_table(self) -> list[dict[str, Any]]:
        return self.meta.get("eval", [])


# ------------------------------------------------------------------------------------------------
# supervised training
# ------------------------------------------------------------------------------------------------


def collate(tokenizer: CharTokenizer, prompts: list[str],
            responses: Sequence[str | Sequence[tuple[str, bool]]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forcing batch: input_ids (B, S) = ``<bos> prompt response <eos>`` right-padded, and
    labels (B, S) = the next token at each position where that token is part of the response
    (incl. <eos>), ``-100`` elsewhere (prompt, padding) — so logits[:, t] predicts labels[:, t].
    A response may be (text, trained) segments (a tool trajectory): the tokens of a segment
    with trained False (a tool's observation) are context only, labelled ``-100``."""
    seqs, targets = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        p = tokenizer.encode(prompt, add_bos=True)
        segments = [(response, True)] if isinstance(response, str) else list(response)
        r: list[int] = []
        label: list[int] = []
        for text, trained in segments:
            ids = tokenizer.encode(text)
            r += ids
            label += ids if trained else [IGNORE] * len(ids)
        r.append(tokenizer.eos_token_id)
        label.append(tokenizer.eos_token_id)
        seqs.append(p + r[:-1])
        targets.append([IGNORE] * (len(p) - 1) + label)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, (s, t) in enumerate(zip(seqs, targets, strict=True)):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, :len(t)] = torch.tensor(t)
    return ids, labels


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at ``step``: linear warm-up over ``warmup`` steps, then cosine or
    linear decay from 1 to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


def _batch_examples(task: Task, cfg: WarmStartConfig, step: int, rng: torch.Generator):
    """One batch of examples: the task's own mix, or ``difficulty_weights`` per example."""
    batch_seed = cfg.seed * 1_000_003 + step
    if not cfg.difficulty_weights:
        return task.examples("train", cfg.batch_size, seed=batch_seed)
    ks = [k for k, _ in cfg.difficulty_weights]
    weights = torch.tensor([w for _, w in cfg.difficulty_weights], dtype=torch.float64)
    counts = torch.bincount(torch.multinomial(weights, cfg.batch_size, True, generator=rng),
                            minlength=len(ks)).tolist()
    return [ex for k, c in zip(ks, counts, strict=True) if c
            for ex in task.examples("train", c, seed=batch_seed, difficulty=k)]


def train_supervised(model: CausalLM, tokenizer: CharTokenizer, task: Task,
                     cfg: WarmStartConfig, *, steps: int, lr: float, phase: str = "train",
                     progress: ProgressFn | None = None) -> list[float]:
    """Run ``steps`` supervised steps on ``model`` in place; returns the loss of every step."""
    if steps == 0:  # skip building the optimiser: its first use imports torch._dynamo (seconds)
        model.eval()
        return []
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(cfg.beta1, cfg.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(
        s, steps, min(cfg.warmup_steps, steps // 2), cfg.schedule, cfg.min_lr_ratio))
    rng = torch.Generator().manual_seed(cfg.seed)
    model.train()
    losses = []
    for step in range(steps):
        examples = _batch_examples(task, cfg, step, rng)
        if cfg.order_seed is not None:
            order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(
                cfg.order_seed * 1_000_003 + step)).tolist()
            examples = [examples[i] for i in order]
        ids, labels = collate(tokenizer, [ex.prompt for ex in examples],
                              [task.reference_segments(ex) if isinstance(task, ToolTask)
                               else task.reference_response(ex) for ex in examples])
        opt.zero_grad(set_to_none=True)
        if cfg.micro_batches == 1:
            logits, _ = model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
            loss.backward()
        else:  # token-weighted accumulation: the same gradient as the whole batch's mean
            n_tokens = (labels != IGNORE).sum().clamp(min=1)
            loss = torch.zeros(())
            for part_ids, part_labels in zip(ids.tensor_split(cfg.micro_batches),
                                             labels.tensor_split(cfg.micro_batches), strict=True):
                logits, _ = model(part_ids)
                part = F.cross_entropy(logits.flatten(0, 1), part_labels.flatten(),
                                       ignore_index=IGNORE, reduction="sum") / n_tokens
                part.backward()
                loss += part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        current_lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress:
            progress(ProgressEvent(phase, step + 1, steps, losses[-1], current_lr))
    model.eval()
    return losses


# ------------------------------------------------------------------------------------------------
# MoE upcycling
# ------------------------------------------------------------------------------------------------


def upcycle_to_moe(dense: CausalLM, num_experts: int, top_k: int, seed: int = 0,
                   router_std: float = 0.02) -> CausalLM:
    """A Mixtral-format MoE model whose every expert copies the dense layer's MLP.

    Args:
        dense: a dense :class:`CausalLM` (left unchanged).
        num_experts / top_k: experts per layer and experts per token.
        seed / router_std: the router weights (num_experts, d) are N(0, router_std²), seeded.
    Returns:
        an fp32 MoE model computing the same function as ``dense`` (see the module docstring).
    """
    if dense.config.is_moe:
        raise ValueError("upcycle_to_moe needs a dense checkpoint; this one is already MoE")
    moe_cfg = replace(dense.config, num_experts=num_experts, num_experts_per_tok=top_k)
    moe = CausalLM(moe_cfg)
    g = torch.Generator().manual_seed(seed)
    src = {k: v.detach().float() for k, v in dense.state_dict().items()}
    with torch.no_grad():
        for name, param in moe.named_parameters():
            if ".block_sparse_moe.gate." in name:
                param.copy_(torch.randn(param.shape, generator=g) * router_std)
            elif ".block_sparse_moe.experts." in name:
                prefix, rest = name.split(".block_sparse_moe.experts.")
                dense_proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[
                    rest.split(".")[1]]
                param.copy_(src[f"{prefix}.mlp.{dense_proj}.weight"])
            else:
                param.copy_(src[name])
    return moe.eval()


def expert_divergence(model: CausalLM) -> float:
    """How far the experts of an MoE model have moved apart: the mean, over layers, projections
    (w1/w2/w3) and expert pairs i < j, of ||W_i − W_j|| / ||W_j|| (exactly 0 right after
    upcycling)."""
    values = []
    for layer in model.model.layers:
        experts = layer.block_sparse_moe.experts
        for proj in ("w1", "w2", "w3"):
            w = [getattr(e, proj).weight.detach() for e in experts]
            values += [((w[i] - w[j]).norm() / w[j].norm()).item()
                       for j in range(len(w)) for i in range(j)]
    return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------------------------------------
# the entry point
# ------------------------------------------------------------------------------------------------


def free_cores() -> int:
    """Intra-op threads that will not oversubscribe: the CPUs this process may run on
    (its affinity), less the work already running on them, at least 1.

    The busy work is measured as the non-idle time of those CPUs over 0.2 s (/proc/stat); when
    the affinity covers the whole machine, the 1-minute load average caps it too (a smoother
    signal: a neighbour between two steps is not free cores). Torch's OpenMP threads spin at
    every barrier while they wait (``OMP_WAIT_POLICY`` is read only when torch is imported, so it
    cannot be changed here); on oversubscribed cores that spinning burned ~2.5x the CPU time of a
    warm start, which one thread per free core avoids.
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    total = os.cpu_count() or len(allowed)
    free = float(len(allowed))
    try:
        def sample() -> dict[int, tuple[int, int]]:
            out = {}
            for line in Path("/proc/stat").read_text().splitlines():
                name, *values = line.split()
                if name.startswith("cpu") and name[3:].isdigit():
                    ticks = [int(v) for v in values]
                    out[int(name[3:])] = (sum(ticks[:8]), ticks[3] + ticks[4])  # total, idle
            return out
        before = sample()
        time.sleep(0.2)
        after = sample()
        idle = 0.0
        for cpu in allowed:
            dt = after[cpu][0] - before[cpu][0]
            idle += (after[cpu][1] - before[cpu][1]) / dt if dt > 0 else 1.0
        free = min(free, idle + 0.25)  # a core ~75% idle counts as free
    except (OSError, KeyError, ValueError, IndexError):
        pass
    if len(allowed) >= total:
        with contextlib.suppress(OSError):
            free = min(free, total - os.getloadavg()[0] + 0.5)
    return max(1, min(len(allowed), int(free)))


class _threads:
    """Set torch's intra-op threads for the duration of a ``with`` block, then restore them."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def __enter__(self) -> int:
        self.previous = torch.get_num_threads()
        n = self.n if self.n is not None else free_cores()
        if n != self.previous:
            torch.set_num_threads(n)
        return n

    def __exit__(self, *exc: object) -> None:
        if torch.get_num_threads() != self.previous:
            torch.set_num_threads(self.previous)


def _cached(path: Path) -> bool:
    try:
        check_hf_dir(path)
    except Exception:
        return False
    return (path / "asyncrl.json").is_file()


def _check_out(out: Path) -> None:
    """Refuse to replace a non-empty directory that is not a checkpoint (e.g. ``--out .``)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise FileExistsError(f"--out {out} is a non-empty directory that is not a checkpoint; "
                              "pass a new or empty directory")


def _copy_dir(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` atomically (assembled next to ``dst``, then moved into place by
    :func:`training.fileio.replace_dir`)."""
    if src.resolve() == dst.resolve():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    shutil.copytree(src, tmp)
    replace_dir(tmp, dst)  # fsynced; a kill between its renames is undone by recover_dir


def _run_eval(model: CausalLM, tokenizer: CharTokenizer, task: Task, cfg: WarmStartConfig,
              progress: ProgressFn | None) -> tuple[EvalResult, float]:
    if progress:
        progress(ProgressEvent("eval", 0, 0))
    start = time.perf_counter()
    result = evaluate(model, tokenizer, task, "eval", cfg.eval_n,
                      batch_size=cfg.eval_batch_size)
    return result, time.perf_counter() - start


def _train_dense(cfg: WarmStartConfig, task: Task, digest: str, target: Path,
                 progress: ProgressFn | None) -> dict[str, Any]:
    tokenizer = CharTokenizer()
    torch.manual_seed(cfg.seed)
    model = CausalLM(cfg.model_config(tokenizer)).init_weights(cfg.seed)
    with _threads(cfg.threads) as threads:
        start, cpu_start = time.perf_counter(), time.process_time()
        losses = train_supervised(model, tokenizer, task, cfg, steps=cfg.steps, lr=cfg.lr,
                                  progress=progress)
        train_s, train_cpu = time.perf_counter() - start, time.process_time() - cpu_start
        result, eval_s = _run_eval(model, tokenizer, task, cfg, progress)
    meta = {"kind": "warmstart", "task": task.describe(), "config": cfg.to_dict(),
            "config_hash": digest, "parameters": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(train_s, 2), "train_cpu_seconds": round(train_cpu, 2),
            "threads": threads, "eval_seconds": round(eval_s, 2),
            "final_loss": losses[-1] if losses else None, "eval": result.table()}
    save_hf_dir(target, model, tokenizer, weight_version=0, meta=meta)
    return meta


def _train_moe(cfg: WarmStartConfig, task: Task, digest: str, dense_dir: Path, target: Path,
               progress: ProgressFn | None) -> dict[str, Any]:
    dense = load_hf_dir(dense_dir)
    moe = upcycle_to_moe(dense.model, cfg.moe_experts, cfg.moe_top_k, seed=cfg.seed,
                         router_std=cfg.moe_router_std)
    with _threads(cfg.threads) as threads:
        start = time.perf_counter()
        losses = train_supervised(moe, dense.tokenizer, task, cfg, steps=cfg.moe_finetune_steps,
                                  lr=cfg.moe_finetune_lr, phase="moe_finetune",
                                  progress=progress)
        train_s = time.perf_counter() - start
        result, eval_s = _run_eval(moe, dense.tokenizer, task, cfg, progress)
    meta = {"kind": "warmstart_moe", "task": task.describe(), "config": cfg.to_dict(),
            "config_hash": digest, "upcycled_from": read_meta(dense_dir).get("config_hash"),
            "parameters": sum(p.numel() for p in moe.parameters()),
            "moe_finetune_seconds": round(train_s, 2), "threads": threads,
            "eval_seconds": round(eval_s, 2),
            "final_loss": losses[-1] if losses else None,
            "expert_divergence": expert_divergence(moe), "eval": result.table()}
    save_hf_dir(target, moe, dense.tokenizer, weight_version=0, meta=meta)
    return meta


def warm_start(cfg: WarmStartConfig, out: str | Path | None = None, *, use_cache: bool = True,
               progress: ProgressFn | None = None) -> WarmStartResult:
    """Train (or fetch from the cache) the warm-start checkpoint for ``cfg``.

    Args:
        cfg: the warm-start config.
        out: where to put the checkpoint (replaced if it is a checkpoint; a non-empty directory
            that is not one is refused). None = leave it in the cache and return that path.
        use_cache: False retrains even on a cache hit (and refreshes the cache entry).
        progress: called after every step and before the evaluation (for a progress bar).
    Returns:
        a :class:`WarmStartResult` (path, cache_hit, config_hash, meta with the eval table).
    """
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        _check_out(out_path)
    task = cfg.build_task()
    digest = config_hash(cfg, task)
    cached = cache_dir("warmstart") / f"{cfg.task}-{digest}"
    hit = use_cache and _cached(cached)
    if not hit:
        if cfg.is_moe:
            dense = warm_start(cfg.dense(), None, use_cache=use_cache, progress=progress)
            _train_moe(cfg, task, digest, dense.path, cached, progress)
        else:
            _train_dense(cfg, task, digest, cached, progress)
    final = cached
    if out_path is not None:
        _copy_dir(cached, out_path)
        final = out_path
    return WarmStartResult(path=final, cache_hit=hit, config_hash=digest, meta=read_meta(final))
