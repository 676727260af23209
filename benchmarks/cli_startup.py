"""CLI start-up: how long `asyncrl --help` and the registry's read commands take in a fresh
process, the way a user types them, beside what no typer CLI can go below (a bare interpreter
and `import typer`), in the same run.

    python benchmarks/cli_startup.py            # 5 runs of each command
    python benchmarks/cli_startup.py --runs 9

Commands run interleaved (one of each per round, after one untimed round), so a change in the
machine's load hits them alike. `campaign status` runs on a fresh empty state directory each time
(a new user's first command) and on one whose registry holds one campaign, written once with the
RegistryDB API before any timing. A third floor is a one-command typer app parsing an argument
and an option (typer converts parameters with pydantic: every command with parameters pays it).
Prints best and median seconds, the best over the `import typer` floor, and last the slowest
command's best against the 0.5 s target (issue 16).

Modules are loaded from bytecode, as in an installed package: with PYTHONDONTWRITEBYTECODE set
(as in some sandboxes) every start would compile the project's own modules from source, so the
processes get a private bytecode cache (PYTHONPYCACHEPREFIX in the scratch directory, filled by
the untimed round); `--no-bytecode-cache` measures the environment as it is.

The code measured is whatever `import ui.cli` finds (the installed tree, or one PYTHONPATH
names). `--before DIR` runs every asyncrl command a second time, interleaved in the same rounds,
on the source tree DIR (e.g. `git worktree add /tmp/cli-before <commit>`: same venv, older code)
and adds its columns and the before/now ratio:

    python benchmarks/cli_startup.py --runs 7 --before /tmp/cli-before
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: a tree named there is the one measured

TARGET_S = 0.5
CAMPAIGN_ID = "bench-ladder-1"
TYPER_APP = """
import typer

def main(name: str = typer.Argument(...), as_json: bool = typer.Option(False, "--json")):
    pass

typer.run(main)
"""


@dataclass(frozen=True)
class Command:
    label: str
    argv: list[str]
    home: str  # "none" | "empty" (a fresh empty directory each run) | "populated"
    exit_code: int = 0
    expect: str = ""  # a string its output must contain (it did the work, not an error)
    baseline: bool = False


def asyncrl() -> list[str]:
    """The console script beside this interpreter (what a user runs), else the same entry point
    through ``-c``."""
    script = Path(sys.executable).parent / "asyncrl"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from ui.cli import app; sys.exit(app())"]


def commands() -> list[Command]:
    cli = asyncrl()
    return [
        Command("python -c pass", [sys.executable, "-c", "pass"], "none", baseline=True),
        Command('python -c "import typer"', [sys.executable, "-c", "import typer"], "none",
                baseline=True),
        Command("typer app: one command, an argument and an option",
                [sys.executable, "-c", TYPER_APP, "x", "--json"], "none", baseline=True),
        Command("asyncrl --help", [*cli, "--help"], "none", expect="campaign"),
        Command("asyncrl campaign status (empty state dir)", [*cli, "campaign", "status"],
                "empty", exit_code=1, expect="no campaigns yet"),
        Command("asyncrl campaign status (one campaign)", [*cli, "campaign", "status"],
                "populated", expect=CAMPAIGN_ID),
        Command("asyncrl campaign status ID", [*cli, "campaign", "status", CAMPAIGN_ID],
                "populated", expect="promoted"),
        Command("asyncrl campaign list", [*cli, "campaign", "list"], "populated",
                expect="ladder"),
    ]


def populate(home: Path) -> None:
    """A registry with one finished campaign: a stage, two candidate runs with summaries and
    gate results, one auto promotion."""
    from registry.db import DEFAULT_FILE, RegistryDB

    with RegistryDB(f"sqlite:///{home / DEFAULT_FILE}") as db:
        db.create_campaign(CAMPAIGN_ID, "ladder", {"name": "ladder", "path": "ladder.yaml"})
        db.upsert_stage(CAMPAIGN_ID, "sync", 0, "running")
        for cand, recipe_hash, reward in (("a", "a" * 64, 0.41), ("b", "b" * 64, 0.47)):
            db.put_recipe(recipe_hash, f"tiny-{cand}", "model: tiny\nsteps: 10\n")
            run_id = db.upsert_run(CAMPAIGN_ID, "sync", cand, recipe_hash, status="finished",
                                   summary={"rollout/reward_mean": reward,
                                            "eval/reward_mean": reward - 0.02})
            db.record_gate_results(run_id, [
                {"name": "reward_not_collapsed", "passed": True, "value": reward,
                 "threshold": 0.1, "window": (1, 10), "evidence": "reward held"},
                {"name": "logprob_diff_flat", "passed": cand == "b", "value": 0.003,
                 "threshold": 0.002},
            ])
        db.promote(recipe_hash="b" * 64, candidate="b", checkpoint="/tmp/ckpt",
                   campaign_id=CAMPAIGN_ID, stage="sync", reason="best reward")
        db.upsert_stage(CAMPAIGN_ID, "sync", 0, "finished")
        db.set_campaign_status(CAMPAIGN_ID, "finished", verdict="sync: promoted b")


def run_once(cmd: Command, home: Path | None, cwd: Path, env: dict[str, str]) -> float:
    if home is not None:
        env = {**env, "ASYNCRL_HOME": str(home)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd.argv, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode != cmd.exit_code or cmd.expect not in out:
        sys.exit(f"{cmd.label}: exit {proc.returncode} (expected {cmd.exit_code}), output "
                 f"without {cmd.expect!r}:\n{out[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per command")
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="also run the asyncrl commands on this source tree (PYTHONPATH=DIR)")
    ap.add_argument("--no-bytecode-cache", action="store_true",
                    help="keep the environment's PYTHONDONTWRITEBYTECODE/PYTHONPYCACHEPREFIX")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="asyncrl-cli-startup-"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("ASYNCRL_REGISTRY_URL", "ASYNCRL_HOME")}
    if not args.no_bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    variants = {"now": env}
    if args.before is not None:
        path = os.pathsep.join(p for p in (str(args.before.resolve()), env.get("PYTHONPATH"))
                               if p)
        variants["before"] = {**env, "PYTHONPATH": path}
    cmds = commands()
    times: dict[tuple[str, str], list[float]] = {}
    try:
        populated = work / "populated"
        populated.mkdir()
        populate(populated)
        for i in range(-1, args.runs):  # round -1 warms the caches, untimed
            for cmd in cmds:
                for variant, venv in variants.items():
                    if cmd.baseline and variant != "now":
                        continue
                    home = {"none": None, "populated": populated}.get(cmd.home)
                    if cmd.home == "empty":
                        home = work / f"empty-{variant}-{i + 1}"
                        home.mkdir()
                    # cwd: the scratch dir, so neither the repository nor a worktree shadows
                    # what PYTHONPATH names
                    seconds = run_once(cmd, home, work, venv)
                    if i >= 0:
                        times.setdefault((cmd.label, variant), []).append(seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    floor = min(times[('python -c "import typer"', "now")])
    width = max(len(c.label) for c in cmds)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cache = ("environment's bytecode settings" if args.no_bytecode_cache
             else "private bytecode cache")
    print(f"{args.runs} fresh processes per command, interleaved; {cache}; load average "
          f"{load}; {sys.executable}")
    head = f"{'command':<{width}}  {'best s':>7}  {'median s':>8}  {'over typer s':>12}"
    if args.before is not None:
        head += f"  {'before best':>11}  {'before median':>13}  {'before/now':>10}"
    print(head)
    for cmd in cmds:
        ts = times[(cmd.label, "now")]
        over = "" if cmd.baseline else f"{min(ts) - floor:+.3f}"
        row = f"{cmd.label:<{width}}  {min(ts):7.3f}  {statistics.median(ts):8.3f}  {over:>12}"
        before = times.get((cmd.label, "before"))
        if before:
            row += (f"  {min(before):11.3f}  {statistics.median(before):13.3f}  "
                    f"{min(before) / min(ts):9.2f}×")
        print(row)
    worst = max((c for c in cmds if not c.baseline), key=lambda c: min(times[(c.label, "now")]))
    best = min(times[(worst.label, "now")])
    print(f"slowest: {worst.label}: best {best:.3f} s vs target {TARGET_S} s "
          f"({best / TARGET_S:.2f}× the target)")


if __name__ == "__main__":
    main()
