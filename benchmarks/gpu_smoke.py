"""GPU smoke test — the first thing to run on a GPU node (never in CI).

One SGLang engine (``engines.rollout: sglang``, one GPU) and one Megatron rank
(``engines.train: megatron``, one GPU) train a small HF model for 5 steps of a one-step-async
recipe through the real runtime (Ray actors, asyncrl's router, weight sync from disk or by
NCCL); then the script prints, per step, the train–rollout mismatch (SGLang's log-probs vs
Megatron's recompute), the weight-sync time and tokens/s, and the full mismatch table of the first
step (staleness 0: pure engine mismatch, seed 001's zero-staleness check).

    python benchmarks/gpu_smoke.py                      # the embedded warm start, 5 steps
    python benchmarks/gpu_smoke.py --model /path/to/hf  # an HF Llama/Mixtral-style directory
    python benchmarks/gpu_smoke.py --ray-address auto   # on a Ray cluster's head node (no GPU
                                                        # needed there: the cluster has them)
    python benchmarks/gpu_smoke.py --weight-sync nccl --precision bf16   # the GPU-only paths
    python benchmarks/gpu_smoke.py --mode fully_async   # partial rollout: SGLang abort + resume

Needs 2 GPUs (engine + rank; Ray gives each its own), SGLang (``pip install -e ".[gpu]"``) and
megatron-core (``.[megatron]``); without them it prints one line saying which is missing and
exits with status 2.

Expected output (figures vary by GPU; what matters is their order of magnitude):

- the warm start (cached), then Ray placing 1 engine × 1 GPU; SGLang loads in ~30-90 s (kernel
  JIT on first use), Megatron in ~10-30 s;
- 5 step lines: ``rollout/reward_mean`` near the warm start's (0.3-0.5 on sum_digits),
  ``|Δlogp| mean`` 0.005-0.03 (SGLang bf16 vs Megatron; FACTS.md quotes ~0.01-0.03; above 0.1
  means the engines disagree: wrong dtype, wrong weights, a tokenizer or position mismatch),
  ``weight sync`` 0.5-5 s for a small model from local disk, tokens/s in the thousands;
- the mismatch table of step 0 with the decision tree's usual reading: Pearson of probs > 0.99,
  PPL ratio within 1 ± 0.05, for MoE a routing flip rate of a few percent or less;
- with ``--mode fully_async`` (partial rollout; SGLang's requests are aborted at each sync and
  resumed from their tokens, ``async.interrupt: abort_resume``): staleness up to 2, a partial
  ratio above 0 on most steps and as many resumed requests as partial samples or more;
- ``verdict: OK`` when every step trained, the engine served every synced weight version,
  |Δlogp| mean stayed below 0.1 and (fully_async) every sample that spanned a sync was resumed,
  none redone from scratch; otherwise ``verdict: CHECK`` with the reason.

The run directory (metrics.jsonl, checkpoint, engine logs under $ASYNCRL_HOME/logs/<run>) is kept
for inspection; its path is printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

STEP_COLUMNS = (
    ("rollout/reward_mean", "reward"),
    ("mismatch/train_rollout/logprob_abs_diff/mean", "|Δlogp| mean"),
    ("mismatch/train_rollout/logprob_abs_diff/p99", "|Δlogp| p99"),
    ("async/staleness/mean", "staleness"),
    ("async/weight_sync_s", "weight sync s"),
    ("async/tokens_per_s", "tokens/s"),
    ("step/weight_version", "version"),
    ("async/partial_ratio", "partial ratio"),
    ("async/rollouter/resumed_requests", "resumed"),
)
MISMATCH_LIMIT = 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory (default: the embedded warm start)")
    p.add_argument("--steps", type=int, default=5, help="trainer steps (default 5)")
    p.add_argument("--moe", action="store_true",
                   help="an MoE warm start with R3 routing replay (ignored with --model)")
    p.add_argument("--mem-fraction", type=float, default=0.6,
                   help="SGLang --mem-fraction-static (default 0.6)")
    p.add_argument("--weight-sync", choices=("disk", "nccl"), default="disk",
                   help="engines.sglang.weight_sync: HF export + /update_weights_from_disk, or "
                        "a broadcast from the Megatron rank (default disk)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="engines.megatron.precision of the trainer (default fp32)")
    p.add_argument("--mode", choices=("one_step", "fully_async"), default="one_step",
                   help="async.mode: one_step, or fully_async with partial rollout (default "
                        "one_step)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster")
    p.add_argument("--out", default=None, help="run directory (default under $ASYNCRL_HOME)")
    return p.parse_args(argv)


def preflight(ray_address: str | None = None) -> str | None:
    """Why this node (or, with ``ray_address``, this Ray cluster, joined here and left
    connected for the run) cannot run the smoke test, in one line; None when it can."""
    from training.engines.sglang.launch import SGLANG_MISSING

    if importlib.util.find_spec("sglang") is None:
        return SGLANG_MISSING
    if importlib.util.find_spec("megatron") is None or \
            importlib.util.find_spec("megatron.core") is None:
        return ('engines.train: megatron needs megatron-core; install it with '
                'pip install -e ".[megatron]"')
    if ray_address:  # the driver may sit on a CPU head node: count the cluster's GPUs
        import ray

        from training.ray_setup import RayStartError, init_ray

        try:
            init_ray(ray_address)
        except RayStartError as e:
            return str(e)
        gpus = ray.cluster_resources().get("GPU", 0.0)
        if gpus < 2:
            return (f"the Ray cluster at {ray_address} has {gpus:g} GPUs; needs 2 (one SGLang "
                    "engine + one Megatron rank)")
        return None
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False); run on a GPU node"
    if torch.cuda.device_count() < 2:
        return (f"needs 2 GPUs (one SGLang engine + one Megatron rank), found "
                f"{torch.cuda.device_count()}")
    return None


def smoke_recipe(args: argparse.Namespace):
    from training.recipe import recipe_from_dict

    if args.model:
        model = {"kind": "checkpoint", "path": str(Path(args.model).expanduser())}
    else:  # the embedded warm start: a tiny Llama/Mixtral HF directory SGLang can load
        model = {"kind": "warmstart", "hidden_size": 256, "num_layers": 4,
                 **({"moe_experts": 4, "moe_top_k": 2} if args.moe else {})}
    return recipe_from_dict({
        "name": "gpu-smoke", "steps": args.steps, "model": model,
        "rollout": {"n": 8, "batch_prompts": 16, "max_response_tokens": 32},
        "async": ({"mode": "one_step"} if args.mode == "one_step" else
                  {"mode": "fully_async", "staleness_threshold": 0.5, "partial_rollout": True,
                   "max_off_policy_steps": 2}),
        "eval": {"every": 0, "n": 0},
        "algorithm": {"routing_replay": "r3" if args.moe and not args.model else "none"},
        "engines": {
            "rollout": "sglang", "train": "megatron", "num_rollout_engines": 1,
            "sglang": {"tp_size": 1, "mem_fraction_static": args.mem_fraction,
                       "weight_sync": args.weight_sync, "startup_timeout_s": 900,
                       "max_restarts": 1,
                       # small head dims (the warm start's 64) and a fast start: triton
                       # attention, no CUDA-graph capture
                       "extra_args": ["--attention-backend", "triton", "--disable-cuda-graph"]},
            "megatron": {"tensor_parallel": 1, "gpus_per_rank": 1.0,
                         "precision": args.precision},
        },
    })


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and (abs(value) >= 1000 or value.is_integer()):
        return f"{value:.0f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def report(result, wall_s: float) -> int:
    from training.engines.mismatch import TABLE_ROWS
    from training.runtime.sinks import read_metrics

    rows = [r for r in read_metrics(result.metrics_path) if not r.get("step/eval_only")]
    print(f"\nrun dir {result.run_dir}  ({result.steps_done} steps, {wall_s:.0f} s)")
    print(" ".join(f"{h:>14}" for h in ("step", *(label for _, label in STEP_COLUMNS))))
    for r in rows:
        print(" ".join(f"{x:>14}" for x in (str(r["step"]),
                                              *(_fmt(r.get(k)) for k, _ in STEP_COLUMNS))))
    if not rows:
        print("verdict: CHECK — no step finished; see the engine logs")
        return 1
    first = rows[0]
    print("\nmismatch at step 0 (SGLang bf16 rollout vs Megatron recompute):")
    for key, label in TABLE_ROWS:
        if key in first:
            print(f"  {label:<32} {_fmt(first[key])}")
    problems = []
    if result.steps_done < len(rows) or any(r.get("async/batch_rejected") for r in rows):
        problems.append("a batch was rejected")
    worst = max((r.get("mismatch/train_rollout/logprob_abs_diff/mean") or 0.0) for r in rows)
    if worst > MISMATCH_LIMIT:
        problems.append(f"|Δlogp| mean reached {worst:.3f} > {MISMATCH_LIMIT}")
    versions = [r.get("step/weight_version") for r in rows]
    if versions != sorted(versions):
        problems.append("weight versions went backwards")
    last = rows[-1]
    if last.get("async/rollouter/sample_retries"):
        problems.append(f"{last['async/rollouter/sample_retries']:.0f} samples were generated "
                        "again (an engine failed, or an aborted request was redone, not resumed)")
    partial = sum(r.get("async/partial_samples") or 0.0 for r in rows)
    if partial > (last.get("async/rollouter/resumed_requests") or 0.0):
        problems.append(f"{partial:.0f} trained samples spanned a sync but only "
                        f"{last.get('async/rollouter/resumed_requests') or 0:.0f} requests were "
                        "resumed")
    print("verdict: " + ("OK" if not problems else "CHECK — " + "; ".join(problems)))
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = preflight(args.ray_address)
    if why is not None:
        print(f"gpu_smoke: {why}", file=sys.stderr)
        return 2
    from training.runtime.run import RunError, run_recipe

    recipe = smoke_recipe(args)
    t0 = time.monotonic()
    try:
        result = run_recipe(recipe, out=args.out, steps=args.steps,
                            ray_address=args.ray_address, checkpoint_every=0,
                            progress=lambda s, n, m: print(f"step {s}/{n} done", flush=True))
    except RunError as e:
        print(f"gpu_smoke: {e}", file=sys.stderr)
        return 1
    return report(result, time.monotonic() - t0)


if __name__ == "__main__":
    sys.exit(main())
