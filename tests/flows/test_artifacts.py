"""The Prefect artifact of a stage, from hand-made outcomes: every run's row, each gate with its
value, limit and evidence (a ``|`` in evidence escaped so the table holds), the promotion."""

from __future__ import annotations

from flows.artifacts import artifact_key, stage_report
from flows.results import CandidateOutcome, GateReport, TrainedRun
from registry.gates import GateResult
from training.recipe import recipe_from_dict


def _outcome(name: str, gates: list[GateResult], reward: float, eval_: float | None
             ) -> CandidateOutcome:
    summary = {"rollout/reward_mean": reward, **({} if eval_ is None else
                                                 {"eval/reward_mean": eval_})}
    run = TrainedRun(1, f"/runs/{name}", f"/runs/{name}/final/hf", f"/runs/{name}/m.jsonl",
                     summary)
    report = GateReport(all(g.passed for g in gates), gates, run.run_dir, summary, 64, {}, {})
    return CandidateOutcome(name, recipe_from_dict({"name": name}), "abc123", run, report, None)


def test_the_stage_report_lists_every_run_and_gate():
    ok = GateResult("reward_not_collapsed", True, 0.5, 0.05, (0, 9), "std 0.5 ≥ 0.05", {})
    bad = GateResult("eval_not_degraded", False, 0.25, 0.4, (0, 9), "eval 0.25 | 0.4", {})
    a, b = _outcome("a", [ok, bad], 0.41, 0.25), _outcome("b", [ok], 0.5, None)
    md = stage_report("one-step", [a, b], b, "first_passing: passed 1 gates")
    assert md.splitlines()[:7] == [
        "# Stage `one-step`", "",
        "**Promoted:** `b` (recipe `abc123`): first_passing: passed 1 gates", "",
        "| run | verdict | rollout reward | eval | failed gates |", "|---|---|---|---|---|",
        "| `a` | rejected | 0.41 | 0.25 | eval_not_degraded |"]
    assert "| `b` | promoted | 0.5 | — | — |" in md
    assert "| `eval_not_degraded` | **fail** | 0.25 | 0.4 | eval 0.25 \\| 0.4 |" in md
    assert md.count("| `reward_not_collapsed` | pass | 0.5 | 0.05 |") == 2
    none = stage_report("s", [a], None, "")
    assert none.splitlines()[2] == "**No candidate passed its gates.**"


def test_artifact_keys_are_what_prefect_accepts():
    assert artifact_key("Seed_Ladder-20261128-abc", "one step/2") == \
        "seed-ladder-20261128-abc-one-step-2"
