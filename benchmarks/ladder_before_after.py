"""Each gate's verdict on a replayed ladder, before and after issue 26: the same runs judged by
the gates of an earlier commit (its code and its ``campaigns/seed-ladder.yaml`` gate parameters)
and by the verdicts the campaign recorded (``gate_report.json`` in each run directory).

    git worktree add /tmp/oldgates 70e9610
    python benchmarks/ladder_before_after.py CAMPAIGN_DIR /tmp/oldgates > table.md

``CAMPAIGN_DIR`` is ``$ASYNCRL_HOME/campaigns/<id>``. The earlier gates run in a subprocess with
the old checkout first on ``PYTHONPATH`` (same environment otherwise); each candidate is judged
with its stage's old gates against the same reference run it was judged against now (the stage's
re-run reference where it has one), summarised by the old ``summarize``, with the old context
(the staleness bound). Prints one Markdown table: stage, candidate, the old verdict and the new
one, each failing gate with its value vs its limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_OLD = r"""
import json, sys, yaml
from registry.gates import evaluate_gate, summarize
from training.runtime.sinks import read_metrics
jobs = json.loads(sys.stdin.read())
stages = {s["name"]: s for s in yaml.safe_load(open("campaigns/seed-ladder.yaml"))["stages"]}
out = []
for j in jobs:
    st = stages[j["stage"]]
    hist = read_metrics(j["metrics"])
    ref = summarize(read_metrics(j["reference"])) if j["reference"] else None
    res = []
    for g in st.get("gates", []):
        if j["absolute_only"] and g.get("relative_to"):
            continue
        r = evaluate_gate(g["name"], hist, g.get("params") or {},
                          reference=ref if g.get("relative_to") else None,
                          context={"max_staleness": j["lag"]})
        res.append([r.name, bool(r.passed), r.value, r.threshold])
    out.append(res)
print(json.dumps(out))
"""


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def _cell(results: list[list]) -> str:
    failed = [f"✗ {n} {_fmt(v)} vs {_fmt(t)}" for n, ok, v, t in results if not ok]
    return "pass" if not failed else "; ".join(failed)


def main(campaign_dir: Path, old: Path) -> str:
    jobs, new = [], []
    order = ["baseline", "one-step", "fully-async", "context"]
    reports = sorted(campaign_dir.glob("*/*/gate_report.json"),
                     key=lambda p: (order.index(p.parts[-3]) if p.parts[-3] in order else 9,
                                    p.parent.name))
    for rep in reports:
        data = json.loads(rep.read_text())
        judged = data["judged_with"]
        refs = judged.get("reference_runs") or {}
        ref_dir = next(iter(refs.values()), None)
        # a re-run reference is judged on the absolute gates only, now and (here) before
        absolute = not any(g.get("relative_to") for g in judged["gates"])
        jobs.append({"stage": judged["stage"], "metrics": str(rep.parent / "metrics.jsonl"),
                     "reference": str(Path(ref_dir) / "metrics.jsonl") if ref_dir else None,
                     "absolute_only": absolute,
                     "lag": judged.get("context", {}).get("max_staleness")})
        new.append((judged["stage"], judged["candidate"],
                    [[g["name"], g["passed"], g.get("value"), g.get("threshold")]
                     for g in data["gates"]]))
    env = {**os.environ, "PYTHONPATH": str(old)}
    proc = subprocess.run([sys.executable, "-c", _OLD], input=json.dumps(jobs), text=True,
                          capture_output=True, cwd=old, env=env, check=True)
    before = json.loads(proc.stdout)
    lines = ["| stage | candidate | before (earlier gates) | after (issue-26 gates) |",
             "|---|---|---|---|"]
    for (stage, cand, after), was in zip(new, before, strict=True):
        lines.append(f"| {stage} | {cand} | {_cell(was)} | {_cell(after)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: ladder_before_after.py CAMPAIGN_DIR OLD_CHECKOUT")
    sys.stdout.write(main(Path(sys.argv[1]), Path(sys.argv[2])))
