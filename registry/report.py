"""A campaign's report in Markdown, generated from its records (issue 26): each stage's
candidates with their figures, every gate's value, limit and verdict, the promotion and its reason.

The figures are computed the way the gates compute them (:class:`registry.gates.core.Run`:
training rows, later row wins, eval from every row), so a table can never disagree with a
verdict: q1 / q4 are the means of the first and last quarter of the points, eval is first → last
with its ``eval/n``. Nothing here writes: the report reads the registry and the run directories.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from registry.gates.core import (
    ENGINE_DIFF,
    EVAL_N,
    EVAL_REWARD,
    LOGPROB_DIFF,
    REWARD,
    STALENESS_MAX,
    Run,
    fmt,
    mean_of,
    quarters,
)

if TYPE_CHECKING:
    from registry.db import RegistryDB
    from registry.records import GateRecord, RunRecord


def _q1_q4(run: Run, key: str) -> str:
    pts = run.series(key)
    if not pts:
        return "—"
    head, tail = quarters(pts, 0.25)
    return f"{fmt(mean_of(head))} → {fmt(mean_of(tail))}"


def _eval(run: Run) -> str:
    ev = run.series(EVAL_REWARD)
    if not ev:
        return "—"
    n = dict(run.series(EVAL_N)).get(ev[-1][0])
    return f"{fmt(ev[0][1])} → {fmt(ev[-1][1])}" + (f" (n {n:.0f})" if n else "")


def _gate_cell(g: GateRecord) -> str:
    mark = "✓" if g.passed else "✗"
    if g.value is None:
        return f"{mark} {g.name} (does not decide)" if "does not decide" in str(g.evidence) \
            else f"{mark} {g.name}"
    return f"{mark} {g.name} {fmt(g.value)} vs {fmt(g.threshold)}"


#: Reads a run directory's metric history (``[]`` when there is none); the caller supplies it
#: (the CLI: ``training.runtime.sinks.read_metrics``), so the registry stays on the schema side.
HistoryLoader = Callable[[str | None], Sequence[Mapping[str, Any]]]


def _stage_table(runs: Sequence[tuple[RunRecord, list[GateRecord]]], promoted: str | None,
                 load: HistoryLoader) -> list[str]:
    lines = ["| candidate | steps | train–rollout \\|Δlogp\\| q1 → q4 | engine \\|Δlogp\\| q1 → q4 "
             "| reward q1 → q4 | eval first → last | max staleness | gates (value vs limit) | "
             "verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r, gates in runs:
        run = Run(load(r.run_dir))
        st = run.series(STALENESS_MAX)
        verdict = ("promoted" if r.candidate == promoted else
                   "reference" if r.candidate.startswith("reference-") else
                   "passed" if gates and all(g.passed for g in gates) else
                   "failed" if gates else r.status)
        cells = [r.candidate, str(len(run.train)), _q1_q4(run, LOGPROB_DIFF),
                 _q1_q4(run, ENGINE_DIFF), _q1_q4(run, REWARD), _eval(run),
                 fmt(max(v for _, v in st)) if st else "—",
                 "; ".join(_gate_cell(g) for g in gates) or "—", verdict]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def campaign_report(db: RegistryDB, campaign_id: str, load: HistoryLoader, *,
                    evidence: bool = True) -> str:
    """The Markdown report of campaign ``campaign_id`` (ValueError when unknown), the runs'
    histories read with ``load``."""
    row = db.get_campaign(campaign_id)
    if row is None:
        raise ValueError(f"no campaign {campaign_id!r}; `asyncrl campaign list` shows them")
    promotions = {p.stage: p for p in db.promotions(campaign_id=campaign_id, status=None)}
    out = [f"# Campaign `{row.id}` ({row.name}): {row.status}", ""]
    if row.verdict:
        out += [f"Verdict: {row.verdict}", ""]
    for st in sorted(db.stages(campaign_id), key=lambda s: s.index):
        runs = [(r, db.gate_results(r.id)) for r in db.runs(campaign_id, st.name)]
        promo = promotions.get(st.name)
        out += [f"## Stage {st.index + 1}: {st.name} ({st.status})", ""]
        out += _stage_table(runs, promo.candidate if promo else None, load)
        out.append("")
        if promo is not None:
            out += [f"Promoted: **{promo.candidate}** — {promo.reason}", ""]
        if evidence:
            for r, gates in runs:
                for g in gates:
                    out.append(f"- `{r.candidate}` {'PASS' if g.passed else 'FAIL'} "
                               f"`{g.name}`: {g.evidence}")
            out.append("")
    return "\n".join(out).rstrip() + "\n"
