"""The Megatron train engine's parallel layouts side by side, on this machine's CPUs (gloo).

Usage:
    python benchmarks/megatron_parallel.py            # 5 timed steps per layout
    python benchmarks/megatron_parallel.py --quick    # 2 timed steps, for a smoke check

For each layout — the embedded trainer (reference), Megatron world 1, TP=2, DP=2, PP=2 (dense
model) and world 1, DP=2, EP=2, PP=2 (MoE model, R3 replay) — it warm starts the same seeded HF
weights, then times on one fixed batch (32 sequences, ~15-token prompts, ~24-token responses,
micro-batches of 8):

  * ``logprob ms``: one ``compute_log_probs`` pass (median of the timed repeats);
  * ``step ms``: one ``train_step`` (median);
  * ``max |Δlogp|``: the first pass's log-probs against the embedded trainer's (same weights);
  * ``start s``: engine start (Ray actors, process groups, model build, weight load).

Every Megatron layout runs as Ray actors (one per rank, gloo), so world size 2 uses both cores;
the figures are for comparing layouts on the same machine, not absolute GPU expectations.
Ray is started once, with 2 CPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.model import ModelConfig
from training.engines.train import OptimConfig, StepConfig, TokenBatch

OPTIM = OptimConfig(lr=1e-3)


def model_dir(root: Path, experts: int) -> Path:
    cfg = ModelConfig(vocab_size=100, hidden_size=128, num_layers=4, num_heads=4,
                      num_kv_heads=2, intermediate_size=256, num_experts=experts,
                      num_experts_per_tok=2)
    d = root / f"hf-e{experts}"
    EmbeddedTrainEngine.from_config(cfg, seed=0).export_weights(d)
    return d


def make_batch(engine: EmbeddedTrainEngine, n: int = 32) -> TokenBatch:
    """n random prompt/response pairs; for an MoE model with the experts the engine itself
    chooses for them (the rollout routes R3 replays)."""
    cfg = engine.config
    g = torch.Generator().manual_seed(0)

    def ids(lo: int, hi: int) -> list[int]:
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(4, cfg.vocab_size, (k,), generator=g).tolist()

    prompts = [[1, *ids(10, 20)] for _ in range(n)]
    responses = [[*ids(16, 32), 2] for _ in range(n)]
    batch = TokenBatch.from_sequences(prompts, responses)
    if not cfg.is_moe:
        return batch
    routes = engine.compute_log_probs(batch, with_entropy=False).routes
    return TokenBatch.from_sequences(prompts, responses, routes=list(routes))


def measure(engine, batch: TokenBatch, routing: str, repeats: int
            ) -> tuple[torch.Tensor, float, float]:
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(batch.batch_size, batch.response_len, generator=g)
    first = engine.compute_log_probs(batch, routing=routing, micro_batch_size=8).log_probs
    lp_times, step_times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        old = engine.compute_log_probs(batch, routing=routing, micro_batch_size=8).log_probs
        lp_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.train_step(batch, adv, old,
                          config=StepConfig(routing=routing, micro_batch_size=8))
        step_times.append(time.perf_counter() - t0)
    return first, 1e3 * statistics.median(lp_times), 1e3 * statistics.median(step_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps per layout")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from training.engines.megatron.engine import MegatronSettings, MegatronTrainEngine

    torch.set_num_threads(1)
    from training.ray_setup import init_ray

    init_ray(num_cpus=2)  # loopback-only, reaped with this process
    layouts = {
        "dense": [("world 1", {}), ("TP=2", {"tensor_parallel": 2}),
                  ("DP=2", {"data_parallel": 2}), ("PP=2", {"pipeline_parallel": 2})],
        "moe": [("world 1", {}), ("DP=2", {"data_parallel": 2}),
                ("EP=2 (DP=2)", {"expert_parallel": 2, "data_parallel": 2}),
                ("PP=2", {"pipeline_parallel": 2})],
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, experts in (("dense", 0), ("moe", 4)):
            d = model_dir(Path(tmp), experts)
            emb = EmbeddedTrainEngine.from_pretrained(d, optim=OPTIM)
            batch = make_batch(emb)
            routing = "r3" if experts else "free"
            t0 = time.perf_counter()
            ref, lp_ms, step_ms = measure(emb, batch, routing, repeats)
            rows.append((kind, "embedded (1 thread)", 0.0, lp_ms, step_ms, 0.0))
            for name, sizes in layouts[kind]:
                t0 = time.perf_counter()
                meg = MegatronTrainEngine.from_pretrained(d, optim=OPTIM,
                                                          settings=MegatronSettings(**sizes))
                start = time.perf_counter() - t0
                try:
                    first, lp_ms, step_ms = measure(meg, batch, routing, repeats)
                finally:
                    meg.close()
                rows.append((kind, f"megatron {name}", start, lp_ms, step_ms,
                             float((first - ref).abs().max())))
                print(f"  measured {kind} {name}", flush=True)
    ray.shutdown()
    print(f"\n{'model':6} {'layout':22} {'start s':>8} {'logprob ms':>11} {'step ms':>9} "
          f"{'max |Δlogp|':>12}")
    for kind, name, start, lp_ms, step_ms, diff in rows:
        print(f"{kind:6} {name:22} {start:8.1f} {lp_ms:11.0f} {step_ms:9.0f} {diff:12.2e}")


if __name__ == "__main__":
    main()
