"""The Prefect artifact of a stage, from hand-made outcomes: every run's row, each gate with its
value, limit and evidence (a ``|`` in evidence escaped so the table holds), the promotion."""

from __future__ import annotations

from flows.artifacts import artifact_key, stage_report
from flows.results import CampaignOutcome, CandidateOutcome, GateReport, TrainedRun, gate_notes
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
    key = artifact_key("Seed_Ladder-20261128-abc", "one step/2")
    assert key.startswith("seed-ladder-20261128-abc-one-step-2-") and len(key) == 42
    assert artifact_key("c-1", "a.b") != artifact_key("c-1", "a_b")  # not one key for two
    assert artifact_key("e2e-1", "async") == "e2e-1-async"  # kept as is when allowed


def test_the_last_lines_show_failed_gates_with_margins_and_passes_without_a_value():
    import io

    from rich.console import Console

    from ui.campaign_cli import _print_outcome

    ok = GateResult("reward_not_collapsed", True, 0.5, 0.05, (0, 9), "std 0.5 ≥ 0.05", {})
    empty = GateResult("grad_norm_no_spike", True, None, None, None,
                       "not enough steps (2) with grad_norm to judge (need ≥ 4)", {})
    bad = GateResult("eval_not_degraded", False, 0.25, 0.4, (0, 9), "eval [0.25] fell", {})
    a = _outcome("a", [ok, empty, bad], 0.41, 0.25)
    notes = gate_notes("s", [a], stopped=True)
    assert [(n.gate, n.passed, n.margin) for n in notes] == [
        ("grad_norm_no_spike", True, None), ("eval_not_degraded", False, -0.15000000000000002)]
    assert [n.gate for n in gate_notes("s", [a], stopped=False)] == ["grad_norm_no_spike"]
    out = io.StringIO()
    outcome = CampaignOutcome("c-1", "stopped", "stage 's': no candidate passed",
                              gate_notes=notes)
    _print_outcome(Console(file=out, width=80), outcome, None,
                   flow_run_url="http://127.0.0.1:4200/runs/flow-run/abc")
    lines = out.getvalue().splitlines()
    assert "  s/a: grad_norm_no_spike passed without a value — not enough steps (2) with " \
           "grad_norm to judge (need ≥ 4)" in lines
    assert "  s/a: eval_not_degraded failed: value 0.25, limit 0.4, margin -0.15 — eval " \
           "[0.25] fell" in lines
    assert lines[-1] == "Prefect flow run: http://127.0.0.1:4200/runs/flow-run/abc"


def test_a_runs_mlflow_description_comes_from_the_campaign_file():
    from flows.campaign import _run_description
    from registry.campaign import Stage

    st = Stage.model_validate({"name": "s", "description": "what s establishes", "candidates": [
        {"name": "v1.scale", "description": "tries v1"}, {"name": "plain"}]})
    assert _run_description(st, "v1.scale") == "stage s: what s establishes\ncandidate v1.scale: " \
                                               "tries v1"
    assert _run_description(st, "v1.scale.s2").endswith("candidate v1.scale.s2: tries v1")
    assert _run_description(st, "plain").endswith("\ncandidate plain")
    assert _run_description(st, "reference-a.s1").endswith(
        "reference-a.s1: the promoted recipe of stage a, re-run at this stage's start and length "
        "(rerun_reference)")
