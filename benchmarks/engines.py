"""Embedded engines on CPU: generation, train step, weight sync, and the engine-mismatch table.

Usage:
    python benchmarks/engines.py                     # full run (warm starts cached after the first)
    python benchmarks/engines.py --quick             # fewer prompts / steps, for a smoke check
    python benchmarks/engines.py --only generation   # one section (generation / train / mismatch)

Prints, in one run and side by side:
  1. generation tokens/s, dense and MoE: the rollout server (64 concurrent HTTP requests, fixed 64
     new tokens each, bf16), Hugging Face ``transformers`` ``generate`` on the same checkpoint
     directory (bf16, one batch of the same 64 prompts, the same number of new tokens with EOS
     masked by ``min_new_tokens``, plain sampling at temperature 1, KV cache on, one thread like
     the server), and the ratio server ÷ HF (the target is >= 1; the goal 2); HF in fp32 is
     printed beside it (what a CPU user may load instead: fp32 weights, no bf16 rounding);
  2. train-step tokens/s of the fp32 trainer (256 sequences of the warm-start task, PPO loss);
  3. weight-sync time: trainer export to an HF directory + server ``/update_weights_from_disk``;
  4. the same-checkpoint mismatch table (``asyncrl check-mismatch`` metrics) for the rollout modes
     bf16 / fp8-simulated weights / bf16 + logit noise, dense and MoE.
Checkpoints come from ``asyncrl warmstart``'s cache under ``$ASYNCRL_HOME`` (trained on the first
run, ~3 min dense + the MoE upcycle). Each server process uses one thread and the trainer one
thread, so the two cores are not oversubscribed. Both generation sides get one untimed warm-up
call, then report the best of 2 (--quick) or 3 timed calls, and count only generated tokens (the
server: ``output_ids``; HF: the columns after the prompt, checked to be exactly the requested
number).
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

SECTIONS = ("generation", "train", "mismatch")


def checkpoints() -> dict[str, Path]:
    dense = warm_start(WarmStartConfig()).path
    moe = warm_start(WarmStartConfig(moe_experts=4, moe_top_k=2)).path
    return {"dense": Path(dense), "moe": Path(moe)}


def bench_generation(ckpt: Path, batch: int, new_tokens: int, repeats: int = 1) -> float:
    """tokens/s of the bf16 rollout server: ``batch`` concurrent HTTP requests, the best of
    ``repeats`` timed rounds (other work on the machine only ever slows a round down)."""
    with EmbeddedServer(ckpt, dtype="bf16", max_batch=batch) as server:
        server.wait_ready()
        with SyncRolloutClient([server.url]) as client:
            tok_prompt = [1, *range(5, 15)]
            params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=0)
            reqs = [GenerateRequest(tok_prompt, params) for _ in range(batch)]
            client.generate(reqs[:4])  # warm-up
            rates = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                results = [r for g in client.generate(reqs) for r in g]
                dt = time.perf_counter() - t0
                rates.append(sum(len(r.output_ids) for r in results) / dt)
    return max(rates)


def bench_hf_generation(ckpt: Path, batch: int, new_tokens: int, repeats: int = 1,
                        dtype: torch.dtype = torch.bfloat16) -> float:
    """tokens/s of ``transformers`` ``generate`` on ``ckpt``, set up as :func:`bench_generation`.

    The server pays for HTTP and per-request scheduling while HF runs one in-process batch; that
    is still the fair comparison, because in-process ``generate`` is what a user would otherwise
    run for a small model on CPU. ``dtype``: bf16 (the server's precision; the target's row) or
    fp32 (what a CPU user may load instead; printed beside it).
    """
    from transformers import AutoModelForCausalLM  # heavy; only for this row

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server process's thread count (EmbeddedServer threads=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
        tok_prompt = torch.tensor([[1, *range(5, 15)]] * batch)
        kwargs = dict(attention_mask=torch.ones_like(tok_prompt), do_sample=True, temperature=1.0,
                      top_k=0, top_p=1.0, use_cache=True, min_new_tokens=new_tokens,
                      max_new_tokens=new_tokens, pad_token_id=model.config.pad_token_id)
        with torch.inference_mode():
            torch.manual_seed(0)
            model.generate(tok_prompt, **kwargs)  # warm-up
            rates = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = model.generate(tok_prompt, **kwargs)
                dt = time.perf_counter() - t0
                generated = out[:, tok_prompt.shape[1]:]
                assert generated.shape == (batch, new_tokens), \
                    f"HF generated {tuple(generated.shape)}, not {(batch, new_tokens)}"
                rates.append(generated.numel() / dt)
    finally:
        torch.set_num_threads(threads)
    return max(rates)


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
    parser.add_argument("--only", choices=SECTIONS, action="append",
                        help="run only this section (repeatable; default: all)")
    parser.add_argument("--noise", type=float, default=0.2,
                        help="logit-noise σ of the noisy rollout mode (0.1–0.3 puts mean |Δlogp| "
                        "in the 0.01–0.03 range real engines show)")
    args = parser.parse_args()
    sections = args.only or SECTIONS
    prompts = 32 if args.quick else 128
    ckpts = checkpoints()

    if "generation" in sections:
        batch, new_tokens, repeats = 64, 32 if args.quick else 64, 2 if args.quick else 3
        print(f"== generation (bf16, 1 thread, batch {batch} × {new_tokens} new tokens, "
              f"temperature 1, best of {repeats}) ==")
        print(f"{'model':<6} {'server tokens/s':>16} {'HF generate fp32':>17} "
              f"{'HF generate bf16':>17} {'server ÷ HF bf16':>17}")
        for name, ckpt in ckpts.items():
            ours = bench_generation(ckpt, batch, new_tokens, repeats)
            hf32 = bench_hf_generation(ckpt, batch, new_tokens, repeats, torch.float32)
            hf = bench_hf_generation(ckpt, batch, new_tokens, repeats)
            print(f"{name:<6} {ours:>16.0f} {hf32:>17.0f} {hf:>17.0f} {ours / hf:>16.2f}×")

    if "train" in sections:
        print("\n== train step (fp32, 1 thread, vanilla PPO loss) and weight sync ==")
        for name, ckpt in ckpts.items():
            tps, t_export, t_load = bench_train_and_sync(ckpt, 64 if args.quick else 256,
                                                        2 if args.quick else 3)
            print(f"{name:<6} train {tps:>8.0f} tokens/s   sync: export {t_export * 1e3:>6.0f} ms "
                  f"+ server load {t_load * 1e3:>6.0f} ms")

    if "mismatch" in sections:
        print_mismatch(ckpts, prompts, args.noise)


def print_mismatch(ckpts: dict[str, Path], prompts: int, noise: float) -> None:
    modes = [("bf16", "bf16", 0.0), ("fp8-sim", "fp8", 0.0),
             (f"bf16+noise{noise:g}", "bf16", noise)]
    columns: dict[str, dict[str, float]] = {}
    for name, ckpt in ckpts.items():
        for label, dtype, sigma in modes:
            report = run_mismatch_check(ckpt, prompts=prompts, dtype=dtype, logit_noise=sigma)
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
