"""How robust is the supervised warm start to rounding, and what does it cost beside another job?

Runs the warm start (training/engines/warmstart.py, never from the cache) for each config ×
variant, each in its own process, and prints one row per run: greedy accuracy overall and per
difficulty, wall seconds, CPU seconds (getrusage of that process, children included).

Variants (the same config; they change only the rounding, so a converged schedule should give
the same accuracy within noise):
    plain     threads=2
    micro2    threads=2, every batch split in 2 accumulated micro-batches
    reorder   threads=2, the examples of every batch in another order (order_seed=1)
    1thread   threads=1
    busy-2t   threads=2 beside a competing 2-thread torch matmul loop on the same cores (today)
    busy-auto threads=None (sized to the free cores) beside the same competitor
    busy-passive threads=2 with OMP_WAIT_POLICY=PASSIVE (set before torch is imported) beside it

Configs: ``baseline`` = the schedule before issue 26 (700 steps, lr 3e-3, cosine to 0.1×lr),
``default`` = WarmStartConfig()'s current defaults, and candidates (see CONFIGS).

Examples:
    # everything, 2 cores per run pinned side by side (a 16-core machine: ~6 min)
    python benchmarks/warmstart_robustness.py --pin --jobs 16
    # a smoke test
    python benchmarks/warmstart_robustness.py --configs baseline --variants plain,micro2 \\
        --set steps=5 --set eval_n=16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the schedule every campaign's gates were calibrated on before issue 26
BASELINE = {"steps": 700, "batch_size": 64, "lr": 3e-3, "min_lr_ratio": 0.1, "warmup_steps": 50,
            "schedule": "cosine"}
CONFIGS: dict[str, dict] = {
    "baseline": BASELINE,
    "default": {},  # since issue 26: cos0-2e3 with threads sized to the free cores
    "cos0": {**BASELINE, "min_lr_ratio": 0.0},
    "lin0": {**BASELINE, "min_lr_ratio": 0.0, "schedule": "linear"},
    "cos0-2e3": {**BASELINE, "lr": 2e-3, "min_lr_ratio": 0.0},
    "cos0-1.5e3": {**BASELINE, "lr": 1.5e-3, "min_lr_ratio": 0.0},
}
VARIANTS: dict[str, dict] = {
    "plain": {"threads": 2},
    "micro2": {"threads": 2, "micro_batches": 2},
    "reorder": {"threads": 2, "order_seed": 1},
    "1thread": {"threads": 1},
    "busy-2t": {"threads": 2, "_competitor": True},
    "busy-auto": {"threads": None, "_competitor": True},
    "busy-passive": {"threads": 2, "_competitor": True, "_env": {"OMP_WAIT_POLICY": "PASSIVE"}},
}
COMPETITOR = ("import torch, time\ntorch.set_num_threads(2)\na = torch.randn(384, 384)\n"
              "while True:\n    a = torch.tanh(a @ a) \n")


def _parse_value(raw: str):
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return None if raw == "None" else raw


def run_one(spec: dict) -> dict:
    """Child process: one warm start, its accuracy table, wall and CPU seconds."""
    if spec.get("cores"):
        os.sched_setaffinity(0, spec["cores"])
    home = tempfile.mkdtemp(prefix="wsrob-")
    os.environ["ASYNCRL_HOME"] = home
    sys.path.insert(0, str(ROOT))
    from training.engines.warmstart import WarmStartConfig, warm_start

    cfg = WarmStartConfig(**spec["config"])
    r0 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    start = time.perf_counter()
    result = warm_start(cfg, None, use_cache=False)
    wall = time.perf_counter() - start
    r1 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum((b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime)
              for a, b in zip(r0, r1, strict=True))
    meta = result.meta
    return {"accuracy": {str(row["difficulty"]): row["accuracy"] for row in meta["eval"]},
            "wall_s": wall, "cpu_s": cpu, "train_s": meta.get("train_seconds"),
            "threads": meta.get("threads"), "final_loss": meta.get("final_loss")}


def _launch(job: dict, cores: list[int] | None) -> tuple[subprocess.Popen, subprocess.Popen | None]:
    env = {**os.environ, **job["env"]}
    competitor = None
    if job["competitor"]:
        competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=dict(os.environ),
                                      preexec_fn=(lambda: os.sched_setaffinity(0, cores))
                                      if cores else None)
        time.sleep(2.0)  # let it reach its loop (and the load it causes be visible)
    spec = {"config": job["config"], "cores": cores}
    proc = subprocess.Popen([sys.executable, __file__, "--one", json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, text=True)
    return proc, competitor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="baseline,default", help="comma-separated CONFIGS names")
    ap.add_argument("--variants", default="plain,micro2,reorder,1thread,busy-2t,busy-auto",
                    help="comma-separated VARIANTS names")
    ap.add_argument("--busy-configs", default=None,
                    help="configs that get the busy-* variants (default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a WarmStartConfig field in every run (e.g. steps=100)")
    ap.add_argument("--busy-set", action="append", default=[], metavar="KEY=VALUE",
                    help="further overrides for the busy-* runs only (e.g. steps=150: their CPU "
                    "seconds are what they measure)")
    ap.add_argument("--jobs", type=int, default=1, help="CPU cores to fill with runs at once")
    ap.add_argument("--pin", action="store_true", help="pin each run (and its competitor) to its "
                    "own cores (Linux; makes side-by-side runs independent)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one))))
        return

    overrides = dict((k, _parse_value(v)) for k, _, v in (s.partition("=") for s in args.set))
    busy_overrides = dict((k, _parse_value(v))
                          for k, _, v in (s.partition("=") for s in args.busy_set))
    busy_configs = set((args.busy_configs or args.configs).split(","))
    jobs = []
    for name in args.configs.split(","):
        for variant in args.variants.split(","):
            v = dict(VARIANTS[variant])
            if variant.startswith("busy") and name not in busy_configs:
                continue
            competitor, env = v.pop("_competitor", False), v.pop("_env", {})
            jobs.append({"name": name, "variant": variant, "competitor": competitor, "env": env,
                         "config": {**CONFIGS[name], **v, **overrides,
                                    **(busy_overrides if competitor else {})},
                         "cores": 2 if competitor else (v["threads"] or 2)})
    free = sorted(os.sched_getaffinity(0)) if args.pin else []
    budget = args.jobs
    pending = sorted(jobs, key=lambda j: -j["cores"])
    running: list[tuple[dict, subprocess.Popen, subprocess.Popen | None, list[int]]] = []
    rows = []
    while pending or running:
        for job in list(pending):
            if job["cores"] <= budget and (not args.pin or job["cores"] <= len(free)):
                cores = [free.pop(0) for _ in range(job["cores"])] if args.pin else None
                budget -= job["cores"]
                pending.remove(job)
                running.append((job, *_launch(job, cores), cores or []))
        time.sleep(0.5)
        for item in list(running):
            job, proc, competitor, cores = item
            if proc.poll() is None:
                continue
            running.remove(item)
            out = proc.stdout.read() if proc.stdout else ""
            if competitor is not None:
                competitor.kill()
                competitor.wait()
            free.extend(cores)
            budget += job["cores"]
            try:
                row = {"config": job["name"], "variant": job["variant"],
                       **json.loads(out.strip().splitlines()[-1])}
            except (IndexError, json.JSONDecodeError):
                row = {"config": job["name"], "variant": job["variant"], "error": proc.returncode}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.json:
                with args.json.with_suffix(".jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
    print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def print_table(rows: list[dict], args) -> None:
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows = sorted(rows, key=lambda r: (args.configs.split(",").index(r["config"]),
                                       order[r["variant"]]))
    ks = sorted({k for r in rows for k in r.get("accuracy", {}) if k != "all"}, key=int)
    head = (f"{'config':<11} {'variant':<12} {'thr':>3} {'all':>6} "
            + " ".join(f"{'k=' + k:>5}" for k in ks)
            + f" {'wall s':>7} {'train s':>7} {'CPU s':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<11} {r['variant']:<12} failed (exit {r['error']})")
            continue
        acc = r["accuracy"]
        print(f"{r['config']:<11} {r['variant']:<12} {r['threads']!s:>3} {acc['all']:6.3f} "
              + " ".join(f"{acc[k]:5.2f}" for k in ks)
              + f" {r['wall_s']:7.1f} {r['train_s']:7.1f} {r['cpu_s']:7.1f}")
    print()
    for name in args.configs.split(","):
        accs = [r["accuracy"]["all"] for r in rows if r["config"] == name and "accuracy" in r
                and not r["variant"].startswith("busy")]
        if accs:
            print(f"{name}: accuracy over rounding variants {min(accs):.3f}..{max(accs):.3f} "
                  f"(spread {max(accs) - min(accs):.3f}, n={len(accs)})")


if __name__ == "__main__":
    main()
