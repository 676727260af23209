"""The zero-staleness mismatch check (seed 001: measure the same-checkpoint gap before any async
run).

Same weights, same prompts: the rollout engine samples responses and reports the log-prob of every
sampled token; the train engine recomputes those log-probs in fp32. Their gap is pure engine
mismatch (precision, kernels, MoE routing flips) — no policy has moved. The report holds seed 001's
metrics under the learner's engine family (``mismatch/engine/*``, with ``mismatch/engine/exact`` =
1: the trainer runs the very weights the rollout used), the MoE routing flip rate, the same gap
with the rollout's routes replayed (R3), and the decision tree's verdict (cause A, or no
meaningful drift).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.algorithms.decision_tree import Diagnosis, diagnose
from training.algorithms.diagnostics import compute_mismatch_metrics
from training.engines.hf_io import CheckpointError, load_hf_dir, read_meta

# The rows of the printed table, in order: (metric key, label).
TABLE_ROWS: tuple[tuple[str, str], ...] = (
    ("mismatch/engine/logprob_abs_diff/mean", "|Δlogp| mean"),
    ("mismatch/engine/logprob_abs_diff/p50", "|Δlogp| p50"),
    ("mismatch/engine/logprob_abs_diff/p90", "|Δlogp| p90"),
    ("mismatch/engine/logprob_abs_diff/p99", "|Δlogp| p99"),
    ("mismatch/engine/logprob_abs_diff/max", "|Δlogp| max"),
    ("mismatch/engine/logprob_abs_diff_seq/max", "|Δlogp| worst sequence mean"),
    ("mismatch/engine/logprob_abs_diff_high_entropy/mean", "|Δlogp| mean, entropy > 0.1"),
    ("mismatch/engine/kl_k1", "KL k1"),
    ("mismatch/engine/kl_k3", "KL k3"),
    ("mismatch/engine/chi2_token", "χ² token"),
    ("mismatch/engine/chi2_seq", "χ² sequence"),
    ("mismatch/engine/ppl_ratio", "PPL ratio (train / rollout)"),
    ("mismatch/engine/probs_pearson", "Pearson of probs"),
    ("mismatch/engine/probs_abs_diff/max", "probs diff max"),
    ("moe/routing_flip_rate", "MoE routing flip rate"),
    ("mismatch/r3/logprob_abs_diff/mean", "|Δlogp| mean with R3 replay"),
)


@dataclass
class MismatchReport:
    checkpoint: str
    engine: str
    weight_version: int
    sequences: int
    tokens: int
    metrics: dict[str, float]
    diagnosis: Diagnosis
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        if self.diagnosis.findings:
            return "; ".join(f"cause {f.cause}: {f.title}" for f in self.diagnosis.findings)
        if self.diagnosis.healthy:
            return "no meaningful drift"
        return "no cause matched (some agreement metrics between healthy and broken thresholds)"

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint, "engine": self.engine,
            "weight_version": self.weight_version, "sequences": self.sequences,
            "tokens": self.tokens, "settings": self.settings, "metrics": self.metrics,
            "verdict": self.verdict, "healthy": self.diagnosis.healthy,
            "causes": [{"cause": f.cause, "title": f.title, "fix": f.fix,
                        "evidence": [str(e) for e in f.evidence]}
                       for f in self.diagnosis.findings],
        }


def task_from_meta(meta: dict[str, Any], override: str | None = None):
    """The task a checkpoint was trained on (``asyncrl.json``'s ``task``), or ``override``."""
    from training.tasks.registry import TASKS, get_task, load_builtin_tasks

    if override:
        return get_task(override)
    desc = meta.get("task")
    if not isinstance(desc, dict) or "name" not in desc:
        return get_task("sum_digits")
    load_builtin_tasks()
    cls = TASKS.get(desc["name"])
    accepted = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in desc.items() if k in accepted})


def _same_weights(a: Path, b: str | Path) -> bool:
    """Whether two local checkpoint directories hold byte-identical weights (False if unreadable
    here, e.g. a path on the engine's machine)."""
    import hashlib

    def digest(d: Path) -> str | None:
        f = Path(d) / "model.safetensors"
        if not f.is_file():
            return None
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    da = digest(a)
    return da is not None and da == digest(Path(b))


def routing_flip_rate(rollout_routes: list[np.ndarray | None],
                      train_routes: list[torch.Tensor | None]) -> float | None:
    """Fraction of (position, layer) whose top-k expert *set* differs between the two engines."""
    flips = total = 0
    for r, t in zip(rollout_routes, train_routes, strict=True):
        if r is None or t is None:
            continue
        a = np.sort(np.asarray(r), axis=-1)
        b = np.sort(t.cpu().numpy(), axis=-1)
        n = min(len(a), len(b))
        differ = (a[:n] != b[:n]).any(axis=-1)
        flips += int(differ.sum())
        total += int(differ.size)
    return flips / total if total else None


def run_mismatch_check(
    checkpoint: str | Path,
    engine_url: str | None = None,
    *,
    prompts: int = 64,
    samples_per_prompt: int = 1,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    seed: int = 0,
    dtype: str = "bf16",
    logit_noise: float = 0.0,
    task: str | None = None,
) -> MismatchReport:
    """Run the check; starts (and stops) an embedded server when ``engine_url`` is None.

    Raises :class:`CheckpointError` for a bad checkpoint and ``RolloutEngineError`` when the
    engine is unreachable or serves other weights.
    """
    from training.engines.client import SyncRolloutClient
    from training.engines.embedded.launch import EmbeddedServer
    from training.engines.embedded.trainer import EmbeddedTrainEngine
    from training.engines.rollout import GenerateRequest, RolloutEngineError, SamplingParams
    from training.engines.train import TokenBatch

    if prompts < 1 or samples_per_prompt < 1:
        raise ValueError("--prompts and --samples must be >= 1")
    loaded = load_hf_dir(checkpoint)
    meta = read_meta(checkpoint)
    the_task = task_from_meta(meta, task)
    tok = loaded.tokenizer
    examples = the_task.examples("eval", prompts, seed=seed)
    prompt_ids = [tok.encode(ex.prompt, add_bos=True) for ex in examples]
    limit = max_new_tokens or the_task.max_response_chars() + 1
    sampling = SamplingParams(max_new_tokens=limit, temperature=temperature,
                              n=samples_per_prompt, seed=seed)
    is_moe = loaded.config.is_moe
    requests = [GenerateRequest(ids, sampling, return_logprob=True, return_routed_experts=is_moe)
                for ids in prompt_ids]

    server = None
    if engine_url is None:
        server = EmbeddedServer(checkpoint, dtype=dtype, logit_noise=logit_noise, seed=seed)
        server.start().wait_ready()
        engine_url = server.url
    try:
        with SyncRolloutClient([engine_url]) as client:
            info = client.model_info()
            if int(info.weight_version) != loaded.weight_version:
                raise RolloutEngineError(
                    f"engine {engine_url} serves weight version {info.weight_version} but "
                    f"{checkpoint} is version {loaded.weight_version}; load the same checkpoint "
                    "on the engine (POST /update_weights_from_disk) so the check compares the "
                    "same weights")
            served_path = Path(info.model_path).resolve() if info.model_path else None
            if served_path is not None and served_path != Path(checkpoint).resolve() \
                    and not _same_weights(served_path, checkpoint):
                raise RolloutEngineError(
                    f"engine {engine_url} serves {info.model_path}, not {checkpoint}; start it on "
                    "this checkpoint (or POST /update_weights_from_disk) so the check compares "
                    "the same weights")
            results = [r for group in client.generate(requests) for r in group]
    finally:
        if server is not None:
            server.stop()

    batch = TokenBatch.from_sequences(
        [r.prompt_ids for r in results], [r.output_ids for r in results],
        pad_token_id=tok.pad_token_id,
        routes=[r.routed_experts for r in results] if is_moe else None)
    trainer = EmbeddedTrainEngine(loaded.model, tok, weight_version=loaded.weight_version,
                                  snapshot_budget_bytes=0)
    free = trainer.compute_log_probs(batch, routing="free", temperature=temperature)
    rollout_lp = torch.zeros_like(free.log_probs)
    for i, r in enumerate(results):
        if r.output_logprobs:
            rollout_lp[i, : len(r.output_logprobs)] = torch.tensor(r.output_logprobs)
    mask = batch.response_mask
    metrics = compute_mismatch_metrics(free.log_probs, rollout_lp, mask, entropy=free.entropy,
                                       prefix="mismatch/engine/")
    metrics["mismatch/engine/exact"] = 1.0  # same checkpoint on both sides
    if is_moe:
        flip = routing_flip_rate([r.routed_experts for r in results], list(free.routes or []))
        if flip is not None:
            metrics["moe/routing_flip_rate"] = flip
        r3 = trainer.compute_log_probs(batch, routing="r3", temperature=temperature,
                                       with_entropy=False)
        r3_metrics = compute_mismatch_metrics(r3.log_probs, rollout_lp, mask,
                                              prefix="mismatch/r3/")
        metrics["mismatch/r3/logprob_abs_diff/mean"] = r3_metrics[
            "mismatch/r3/logprob_abs_diff/mean"]
        metrics["mismatch/r3/logprob_abs_diff/p99"] = r3_metrics[
            "mismatch/r3/logprob_abs_diff/p99"]
    trainer.close()
    return MismatchReport(
        checkpoint=str(checkpoint), engine=engine_url if server is None else f"embedded ({dtype})",
        weight_version=loaded.weight_version, sequences=len(results),
        tokens=int(mask.sum()), metrics=metrics, diagnosis=diagnose(metrics),
        settings={"prompts": prompts, "samples_per_prompt": samples_per_prompt,
                  "max_new_tokens": limit, "temperature": temperature, "seed": seed,
                  "dtype": dtype if server is not None else None,
                  "logit_noise": logit_noise if server is not None else None,
                  "task": the_task.describe()})


__all__ = ["TABLE_ROWS", "CheckpointError", "MismatchReport", "routing_flip_rate",
           "run_mismatch_check", "task_from_meta"]
