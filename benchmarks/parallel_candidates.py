"""A stage's candidates one after another (``parallel: 1``) against two at once (``parallel: 2``),
side by side on the same multi-node Ray cluster (platform/local-cluster.sh: head + two workers on
this machine), the campaign launched the way a user does (`asyncrl campaign launch --ray-address`).

The campaign: one stage of two candidates of the embedded default's tiny recipe (2-layer d=32
warm start, 4 prompts × 4 responses, one engine, sync), each run asking ``worker: 1`` per bundle
so the two runs fill the two workers. Rounds alternate 1, 2, 1, 2, … after an unmeasured warm-up
launch (it builds the warm start). Per launch it reports:

- the stage's span: first run's start (its recipe.yaml) to last run's end (its summary.json);
- the whole launch's wall time (the CLI process, Prefect's ephemeral API included).

    python benchmarks/parallel_candidates.py              # 3 rounds, 6 steps per candidate
    python benchmarks/parallel_candidates.py --rounds 2 --steps 4

Only two cores: the two runs share them, so what parallel gains here is the idle time of one run
(its engine waiting for its trainer and the other way round) filled by the other, and the start-up
(Ray actors, the engine server's load) overlapped; a cluster with a core per process gains more.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "platform" / "local-cluster.sh"


def campaign(name: str, parallel: int, steps: int) -> dict:
    tiny = yaml.safe_load((ROOT / "tests" / "tiny-recipe.yaml").read_text())
    tiny["steps"] = steps
    tiny["engines"] = {"num_rollout_engines": 1,
                       "placement": {"trainer": {"worker": 1}, "rollout": {"worker": 1}}}
    return {"name": name, "base": tiny, "parallel": parallel, "stages": [
        {"name": "pair", "promotion": "best_eval",
         "candidates": [{"name": "a"}, {"name": "b", "overrides": {"seed": 7}}],
         "gates": [{"name": "staleness_within_bound"}]}]}


def launch(env: dict[str, str], home: Path, name: str, parallel: int, steps: int
           ) -> tuple[float, float]:
    """(stage span, launch wall time) of one launch."""
    path = home / f"{name}.yaml"
    path.write_text(yaml.safe_dump(campaign(name, parallel, steps)))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ui.cli", "campaign", "launch", str(path),
                          "--id", name, "--ray-address", env["RAY_ADDRESS"]], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        sys.exit(f"launch {name} failed:\n{res.stderr[-3000:]}")
    runs = [home / "campaigns" / name / "pair" / c for c in ("a", "b")]
    start = min((r / "recipe.yaml").stat().st_mtime for r in runs)
    end = max((r / "summary.json").stat().st_mtime for r in runs)
    return end - start, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncrl-par-") as tmp:
        tmp_path = Path(tmp)
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               "PYTHON": sys.executable, "RAY_USAGE_STATS_ENABLED": "0",
               "ASYNCRL_HOME": str(tmp_path / "home"), "OMP_WAIT_POLICY": "PASSIVE"}
        for var in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PREFECT_API_URL",
                    "ASYNCRL_REGISTRY_URL"):
            env.pop(var, None)
        subprocess.run(["bash", str(SCRIPT), "start", str(tmp_path / "cluster")], env=env,
                       check=True)
        try:
            for line in (tmp_path / "cluster" / "env").read_text().splitlines():
                key, _, value = line.removeprefix("export ").partition("=")
                env[key] = value
            home = tmp_path / "home"
            home.mkdir()
            launch(env, home, "warmup", 1, 2)
            got: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
            for r in range(args.rounds):
                for parallel in (1, 2):
                    span, wall = launch(env, home, f"p{parallel}-r{r}", parallel, args.steps)
                    got[parallel].append((span, wall))
                    print(f"round {r} parallel {parallel}: stage {span:.1f} s, launch "
                          f"{wall:.1f} s", flush=True)
        finally:
            subprocess.run(["bash", str(SCRIPT), "stop", str(tmp_path / "cluster")], env=env)
    print(f"\n{'parallel':>8} {'stage median s':>15} {'stage min–max s':>16} "
          f"{'launch median s':>16}")
    for p in (1, 2):
        spans = [s for s, _ in got[p]]
        walls = [w for _, w in got[p]]
        print(f"{p:>8} {statistics.median(spans):>15.1f} "
              f"{min(spans):>7.1f}–{max(spans):<8.1f} {statistics.median(walls):>16.1f}")
    ratios = [a[0] / b[0] for a, b in zip(got[1], got[2], strict=True)]
    print(f"\nstage speed-up of parallel 2 over 1, per round: "
          f"{', '.join(f'{x:.2f}x' for x in ratios)} (median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
