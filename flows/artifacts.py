"""What a campaign shows in the Prefect UI: flow and task runs named after what they run, tags,
and a markdown artifact per judged stage with every run's gate verdicts and the promotion.

The artifact is written from inside the flow run (Prefect attaches it to that run and lists it
under Artifacts, keyed ``<campaign id>-<stage>``, so a resumed stage adds a version of the same
key). Writing it never stops a campaign: a Prefect API that refuses it is a warning in the log.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Sequence

from flows.results import CandidateOutcome
from registry.gates import GateResult

__all__ = ["artifact_key", "gate_report_html", "publish_stage_report", "stage_report",
           "task_run_name"]

log = logging.getLogger("asyncrl.campaign")


def task_run_name(verb: str) -> Callable[[], str]:
    """A task run's name, ``"<verb> <stage>/<candidate>"``, from the task's ``stage`` and
    ``candidate`` parameters (or those of its ``where`` mapping), read when the run starts."""

    def name() -> str:
        from prefect.runtime import task_run

        params = task_run.parameters or {}
        where = params.get("where") or params
        return f"{verb} {where.get('stage', '?')}/{where.get('candidate', '?')}"

    return name


def artifact_key(campaign_id: str, stage: str) -> str:
    """``<campaign id>-<stage>`` in what Prefect's artifact keys allow (lowercase letters, digits,
    dashes); when that changed the name, a short hash of the original keeps two stages whose
    names differ only there (``a.b``, ``a_b``) apart."""
    raw = f"{campaign_id}-{stage}"
    key = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    if key != raw:
        key += "-" + hashlib.sha256(raw.encode()).hexdigest()[:6]
    return key


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def stage_report(stage: str, outcomes: Sequence[CandidateOutcome],
                 winner: CandidateOutcome | None, reason: str, description: str = "") -> str:
    """The stage as markdown: its description, the promotion and its reason (or that nothing
    passed), one row per run (every seed) with its verdict, rollout reward, eval and failed
    gates, then each run's gates (value, limit, verdict, evidence)."""
    runs = [s for o in outcomes for s in o.all_seeds]
    out = [f"# Stage `{stage}`", "", *([description, ""] if description else []),
           f"**Promoted:** `{winner.candidate}` (recipe `{winner.recipe_hash}`): {reason}"
           if winner is not None else f"**No candidate passed its gates.** {reason}".rstrip(),
           "", "| run | verdict | rollout reward | eval | failed gates |",
           "|---|---|---|---|---|"]
    for r in runs:
        s = r.run.summary
        verdict = "promoted" if winner is not None and r is winner else (
            "passed" if r.report.passed else "rejected")
        out.append(f"| `{r.candidate}` | {verdict} | {_num(s.get('rollout/reward_mean'))} | "
                   f"{_num(s.get('eval/reward_mean'))} | "
                   f"{', '.join(r.report.failed_gates) or '—'} |")
    for r in runs:
        out += ["", f"## `{r.candidate}`", "", "| gate | verdict | value | limit | evidence |",
                "|---|---|---|---|---|"]
        for g in r.report.gates:
            evidence = g.evidence.replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{g.name}` | {'pass' if g.passed else '**fail**'} | "
                       f"{_num(g.value)} | {_num(g.threshold)} | {evidence} |")
    return "\n".join(out) + "\n"


def gate_report_html(title: str, gates: Sequence[GateResult], passed: bool) -> str:
    """One run's gate verdicts as a self-contained HTML table (MLflow's artifact viewer shows it
    as a table; ``gate_report.json`` stays the record): gate, verdict, value, limit, the steps
    judged, the evidence."""
    from html import escape

    rows = "".join(
        f"<tr class='{'pass' if g.passed else 'fail'}'><td><code>{escape(g.name)}</code></td>"
        f"<td>{'pass' if g.passed else '<b>FAIL</b>'}</td><td>{_num(g.value)}</td>"
        f"<td>{_num(g.threshold)}</td>"
        f"<td>{'—' if g.window is None else f'{g.window[0]}–{g.window[1]}'}</td>"
        f"<td>{escape(g.evidence)}</td></tr>" for g in gates)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>" + escape(title) + "</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}"
        "tr.fail{background:#fde8e8}</style></head><body>"
        f"<h2>{escape(title)}: {'passed' if passed else 'FAILED'}</h2><table>"
        "<tr><th>gate</th><th>verdict</th><th>value</th><th>limit</th><th>steps</th>"
        f"<th>evidence</th></tr>{rows}</table></body></html>\n")


def publish_stage_report(campaign_id: str, stage: str, markdown: Callable[[], str]) -> None:
    """Attach ``markdown()`` to the running flow run as the artifact :func:`artifact_key`
    (built inside the guard: a report that cannot be made is a warning too)."""
    from prefect.artifacts import create_markdown_artifact

    try:
        create_markdown_artifact(markdown(), key=artifact_key(campaign_id, stage),
                                 description=f"campaign {campaign_id}, stage {stage}: gate "
                                             "verdicts and the promotion")
    except Exception as e:  # the report is for people; the campaign goes on without it
        log.warning("stage %s: the Prefect artifact was not written (%s)", stage, e)
