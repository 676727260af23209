"""Embedded engines on CPU: generation, train step, weight sync, and the engine-mismatch table.

Usage:
    python benchmarks/engines.py            # full run (warm starts are cached after the first)
    python benchmarks/engines.py --quick    # fewer prompts / steps, for a smoke check

Prints, in one run and side by side:
  1. generation tokens/s of the rollout server (64 concurrent requests, fixed 64 new tokens each,
     bf16), dense and MoE;
  2. train-step tokens/s of the fp32 trainer (256 sequences of the warm-start task, PPO loss);
  3. weight-sync time: trainer export to an HF directory + server ``/update_weights_from_disk``;
  4. the same-checkpoint mismatch table (``asyncrl check-mismatch`` metrics) for the rollout modes
     bf16 / fp8-simulated weights / bf16 + logit noise, dense and MoE.
Checkpoints come from ``asyncrl warmstart``'s cache under ``$ASYNCRL_HOME`` (trained on the first
run, ~3 min dense + the MoE upcycle). Each server process uses one thread and the trainer one
thread, so the two cores are not oversubscribed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from training.algorithms.policy_loss import PolicyLossConfig
from training.engines.client import SyncRolloutClient
from training.engines.embedded.launch import EmbeddedServer
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.hf_io import read_meta
from training.engines.mismatch import TABLE_ROWS, run_mismatch_check, task_from_meta
from training.engines.rollout import GenerateRequest, SamplingParams
from training.engines.train import StepConfig, TokenBatch
from training.engines.warmstart import WarmStartConfig, warm_start


def checkpoints() -> dict[str, Path]:
    dense = warm_start(WarmStartConfig()).path
    moe = warm_start(WarmStartConfig(moe_experts=4, moe_top_k=2)).path
    return {"dense": Path(dense), "moe": Path(moe)}


def bench_generation(ckpt: Path, batch: int, new_tokens: int) -> float:
    with EmbeddedServer(ckpt, dtype="bf16", max_batch=batch) as server:
        server.wait_ready()
        with SyncRolloutClient([server.url]) as client:
            tok_prompt = [1, *range(5, 15)]
            params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=0)
            reqs = [GenerateRequest(tok_prompt, params) for _ in range(batch)]
            client.generate(reqs[:4])  # warm-up
            t0 = time.perf_counter()
            results = [r for g in client.generate(reqs) for r in g]
            dt = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in results) / dt


def bench_train_and_sync(ckpt: Path, sequences: int, repeats: int) -> tuple[float, float, float]:
    torch.set_num_threads(1)
    engine = EmbeddedTrainEngine.from_pretrained(ckpt, snapshot_budget_bytes=0)
    task = task_from_meta(read_meta(ckpt))
    tok = engine.tokenizer
    examples = task.examples("train", sequences, seed=1)
    prompts = [tok.encode(e.prompt, add_bos=True) for e in examples]
    responses = [[*tok.encode(task.reference_response(e)), tok.eos_token_id] for e in examples]
    batch = TokenBatch.from_sequences(prompts, responses, pad_token_id=tok.pad_token_id)
    old = engine.compute_log_probs(batch, with_entropy=False).log_probs
    adv = torch.randn(batch.batch_size, 1).expand_as(old).contiguous()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.train_step(batch, adv, old, config=StepConfig(loss_name="vanilla",
                                                             loss_config=PolicyLossConfig()))
        times.append(time.perf_counter() - t0)
    tokens_per_s = batch.num_tokens / statistics.median(times)

    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(ckpt, dtype="bf16") as server:
        server.wait_ready()
        with SyncRolloutClient([server.url]) as client:
            t0 = time.perf_counter()
            version = engine.export_weights(Path(tmp) / "sync")
            t_export = time.perf_counter() - t0
            t0 = time.perf_counter()
            client.update_weights_from_disk(str(Path(tmp) / "sync"), version)
            t_load = time.perf_counter() - t0
    engine.close()
    return tokens_per_s, t_export, t_load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and steps")
    parser.add_argument("--noise", type=float, default=0.2,
                        help="logit-noise σ of the noisy rollout mode (0.1–0.3 puts mean |Δlogp| "
                        "in the 0.01–0.03 range real engines show)")
    args = parser.parse_args()
    prompts = 32 if args.quick else 128
    ckpts = checkpoints()

    new_tokens = 32 if args.quick else 64
    print(f"== generation (bf16 server, 64 concurrent requests × {new_tokens} new tokens) ==")
    for name, ckpt in ckpts.items():
        print(f"{name:<6} {bench_generation(ckpt, 64, new_tokens):>10.0f} tokens/s")

    print("\n== train step (fp32, 1 thread, vanilla PPO loss) and weight sync ==")
    for name, ckpt in ckpts.items():
        tps, t_export, t_load = bench_train_and_sync(ckpt, 64 if args.quick else 256,
                                                    2 if args.quick else 3)
        print(f"{name:<6} train {tps:>8.0f} tokens/s   sync: export {t_export * 1e3:>6.0f} ms + "
              f"server load {t_load * 1e3:>6.0f} ms")

    modes = [("bf16", "bf16", 0.0), ("fp8-sim", "fp8", 0.0),
             (f"bf16+noise{args.noise:g}", "bf16", args.noise)]
    columns: dict[str, dict[str, float]] = {}
    for name, ckpt in ckpts.items():
        for label, dtype, noise in modes:
            report = run_mismatch_check(ckpt, prompts=prompts, dtype=dtype, logit_noise=noise)
            columns[f"{name} {label}"] = {**report.metrics, "_verdict": report.verdict}
    print(f"\n== same-checkpoint mismatch ({prompts} prompts, temperature 1) ==")
    heads = list(columns)
    print(f"{'metric':<34}" + "".join(f"{h:>22}" for h in heads))
    for key, label in TABLE_ROWS:
        if not any(key in c for c in columns.values()):
            continue
        cells = "".join(f"{columns[h][key]:>22.4g}" if key in columns[h] else f"{'—':>22}"
                        for h in heads)
        print(f"{label:<34}{cells}")
    print(f"{'verdict':<34}" + "".join(f"{columns[h]['_verdict'][:21]:>22}" for h in heads))


if __name__ == "__main__":
    main()
