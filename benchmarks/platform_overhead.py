"""Platform overhead: one recipe run bare (`asyncrl train`) and as campaigns of 1, 2 and 4 stages
of it (`asyncrl campaign launch`: Prefect flow + registry + MLflow tracking, gates, plots, model
registration), each as a fresh process the way a user runs it, side by side.

    python benchmarks/platform_overhead.py                  # recipes/sync.yaml, 6 steps a stage
    python benchmarks/platform_overhead.py --stages 1 2     # fewer campaigns
    python benchmarks/platform_overhead.py --steps 12 --recipe recipes/one_step.yaml

Every stage of a campaign is the same recipe at the same steps (each starts from the previous
stage's promoted checkpoint), so:

- fixed start-up = campaign(1 stage) − bare run: what the platform adds before and after the
  work (Prefect's API, MLflow's store, the registry, the last judge and promotion);
- each further stage = (campaign(N) − campaign(M)) / (N − M) for the two largest N, M — beside
  the bare run it replaces (a user bringing a recipe up by hand runs `asyncrl train` once per
  stage, each a fresh process); the ratio is the target's figure (≤ 1.03).

Each campaign runs in a new state directory (Prefect's database, MLflow, the registry created
from scratch, as on a user's first campaign), sharing only the warm-start cache; one more
1-stage campaign runs in the state directory of the first (``second campaign``: databases that
exist). The warm start is built (or taken from the cache) before timing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode not in (0, 2):
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return time.monotonic() - t0, proc.returncode


def campaign_file(work: Path, recipe: Path, steps: int, stages: int) -> Path:
    path = work / f"campaign-{stages}.yaml"
    body = "".join(f"  - name: s{i + 1}\n    steps: {steps}\n"
                   "    gates: [{name: reward_not_collapsed}, {name: logprob_diff_flat}]\n"
                   for i in range(stages))
    path.write_text(f"name: overhead{stages}\nbase: {recipe}\nstages:\n{body}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "sync.yaml")
    ap.add_argument("--steps", type=int, default=6, help="steps of the bare run and of a stage")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4],
                    help="campaign sizes to time (1 is always included)")
    args = ap.parse_args()
    from training.paths import cache_dir
    from training.recipe import load_recipe
    from training.runtime.run import initial_checkpoint

    recipe_path = args.recipe.resolve()
    print("warm start (cached after the first time) ...", flush=True)
    initial_checkpoint(load_recipe(recipe_path))
    work = Path(tempfile.mkdtemp(prefix="asyncrl-overhead-"))
    exe = [sys.executable, "-m", "ui.cli"]
    base_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "ASYNCRL_REGISTRY_URL"):
        base_env.pop(key, None)

    def home(name: str) -> dict[str, str]:
        h = work / name
        if not h.exists():  # share only the warm-start cache
            (h / "cache").mkdir(parents=True)
            os.symlink(cache_dir("warmstart"), h / "cache" / "warmstart")
        return {**base_env, "ASYNCRL_HOME": str(h)}

    rows: list[tuple[str, float, str]] = []
    try:
        bare, _ = timed([*exe, "train", str(recipe_path), "--steps", str(args.steps),
                         "--out", str(work / "bare-run")], home("bare"))
        rows.append(("bare (asyncrl train)", bare, ""))
        print(f"  bare: {bare:.1f} s", flush=True)
        sizes = sorted({1, *args.stages})
        camp: dict[int, float] = {}
        for n in sizes:
            t, code = timed([*exe, "campaign", "launch",
                             str(campaign_file(work, recipe_path, args.steps, n))],
                            home(f"campaign{n}"))
            camp[n] = t
            rows.append((f"{n}-stage campaign", t,
                         "no candidate passed its gates" if code == 2 else ""))
            print(f"  {n}-stage campaign: {t:.1f} s", flush=True)
        again, _ = timed([*exe, "campaign", "launch",
                          str(campaign_file(work, recipe_path, args.steps, 1))],
                         home("campaign1"))
        rows.append(("1-stage, second campaign", again, "state directory of the first"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nplatform overhead — {recipe_path.name}, {args.steps} steps a stage, fresh processes, "
          f"{os.cpu_count()} cores")
    print(f"{'run':<28}{'wall s':>8}{'over bare s':>13}")
    for label, t, note in rows:
        print(f"{label:<28}{t:>8.1f}{t - bare:>+13.1f}" + (f"   ({note})" if note else ""))
    print(f"\nfixed start-up: +{camp[1] - bare:.1f} s over bare (first campaign of a state "
          f"directory), +{again - bare:.1f} s (a later one)")
    if len(sizes) > 1:
        hi, lo = sizes[-1], sizes[-2]
        per_stage = (camp[hi] - camp[lo]) / (hi - lo)
        print(f"each further stage: {per_stage:.1f} s (from {lo} → {hi} stages) vs its bare run "
              f"{bare:.1f} s → ratio {per_stage / bare:.3f}")


if __name__ == "__main__":
    main()
