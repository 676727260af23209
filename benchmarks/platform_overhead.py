"""Platform overhead: one recipe run bare (`asyncrl train`) and as a one-stage campaign
(`asyncrl campaign launch`: Prefect flow + registry + MLflow tracking, plots, gates, model
registration), each as a fresh process the way a user runs it, side by side.

    python benchmarks/platform_overhead.py            # recipes/sync.yaml, 6 steps
    python benchmarks/platform_overhead.py --steps 12 --recipe recipes/one_step.yaml

The warm start is built (or taken from the cache) before timing. Both runs use a fresh state
directory for everything else (Prefect's database, MLflow, the registry are created from scratch,
as on a user's first campaign), sharing only the warm-start cache.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "sync.yaml")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    from training.paths import cache_dir
    from training.recipe import load_recipe
    from training.runtime.run import initial_checkpoint

    recipe = load_recipe(args.recipe)
    print("warm start (cached after the first time) ...", flush=True)
    initial_checkpoint(recipe)
    work = Path(tempfile.mkdtemp(prefix="asyncrl-overhead-"))
    homes = {k: work / k for k in ("bare", "campaign")}
    for h in homes.values():  # share only the warm-start cache
        (h / "cache").mkdir(parents=True)
        os.symlink(cache_dir("warmstart"), h / "cache" / "warmstart")
    exe = [sys.executable, "-m", "ui.cli"]
    base_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    base_env.pop("MLFLOW_TRACKING_URI", None)

    bare, _ = timed([*exe, "train", str(args.recipe.resolve()), "--steps", str(args.steps),
                     "--out", str(work / "bare-run")],
                    {**base_env, "ASYNCRL_HOME": str(homes["bare"])})
    campaign_file = work / "one-stage.yaml"
    campaign_file.write_text(
        f"name: overhead\nbase: {args.recipe.resolve()}\nstages:\n"
        f"  - name: only\n    steps: {args.steps}\n"
        "    gates: [{name: reward_not_collapsed}, {name: logprob_diff_flat}]\n")
    camp, code = timed([*exe, "campaign", "launch", str(campaign_file)],
                       {**base_env, "ASYNCRL_HOME": str(homes["campaign"])})
    print(f"\nplatform overhead — {args.recipe.name}, {args.steps} steps, fresh processes, "
          f"{os.cpu_count()} cores")
    print(f"{'run':<34}{'wall s':>8}")
    print(f"{'bare (asyncrl train)':<34}{bare:>8.1f}")
    print(f"{'one-stage campaign (launch)':<34}{camp:>8.1f}"
          + ("   (no candidate passed its gates)" if code == 2 else ""))
    print(f"overhead: +{camp - bare:.1f} s, ratio {camp / bare:.2f}×")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
