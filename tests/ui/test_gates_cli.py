"""`asyncrl gates RUN --reference REF [--campaign FILE --stage NAME] [--json]` (issue 26): a run
from anywhere, judged against a reference; exit 0 / 3 / 1; absent metrics do not decide."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ui.cli import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
LP = "mismatch/train_rollout/logprob_abs_diff/mean"
WIGGLE = [0.0005, -0.0005] * 20


def _write(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sync(tmp: Path) -> Path:
    return _write(tmp / "sync", [{"step": i, LP: 0.008 + WIGGLE[i], "rollout/reward_mean": 0.5,
                                  "async/staleness/mean": 0.0} for i in range(12)])


def _one_step(tmp: Path, growth: float) -> Path:
    rows = [{"step": 0, LP: 0.009, "async/staleness/mean": 0.0, "rollout/reward_mean": 0.5}]
    rows += [{"step": i, LP: 0.04 + growth * i + WIGGLE[i], "async/staleness/mean": 1.0,
              "rollout/reward_mean": 0.5} for i in range(1, 13)]
    return _write(tmp / f"one-{growth}", rows)


def test_a_flat_lagged_run_passes_against_its_reference_and_a_growing_one_fails(tmp_path):
    ref = _sync(tmp_path)
    ok = runner.invoke(app, ["gates", str(_one_step(tmp_path, 0.0)), "--reference", str(ref),
                             "--gate", "logprob_diff_flat"])
    assert ok.exit_code == 0, ok.output
    assert ok.output.startswith("judged with default parameters")
    assert "PASS logprob_diff_flat" in ok.output and "1 lag-0 step(s) left out" in ok.output
    bad = runner.invoke(app, ["gates", str(_one_step(tmp_path, 0.003)), "--reference", str(ref),
                              "--gate", "logprob_diff_flat", "--json"])
    assert bad.exit_code == 3, bad.output
    out = json.loads(bad.output)
    assert [r["passed"] for r in out["results"]] == [False]
    assert "is growing" in out["results"][0]["evidence"]


def test_a_campaign_stage_gates_a_slime_run_and_absent_metrics_do_not_decide(tmp_path):
    ref = _sync(tmp_path)
    # slime's names: the headline and the reward, nothing else
    slime = _write(tmp_path / "slime", [
        {"step": i, "train/train_rollout_logprob_abs_diff": 0.009 + WIGGLE[i],
         "rollout/raw_reward": 0.5} for i in range(12)])
    res = runner.invoke(app, ["gates", str(slime), "--reference", str(ref), "--campaign",
                              str(REPO / "campaigns" / "seed-ladder.yaml"), "--stage",
                              "one-step", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["judged_with"].startswith("the gates of stage 'one-step'")
    by = {r["name"]: r for r in out["results"]}
    assert by["logprob_diff_flat"]["passed"] and by["logprob_diff_flat"]["value"] is not None
    assert "absent" in by["engine_mismatch_flat"]["evidence"]
    assert by["engine_mismatch_flat"]["value"] is None


def test_bad_input_is_one_line_and_exit_1(tmp_path):
    ref = _sync(tmp_path)
    cases = [
        (["gates", str(tmp_path / "nope")], "has no metrics.jsonl"),
        (["gates", str(ref), "--stage", "one-step"], "--stage needs --campaign"),
        (["gates", str(ref), "--campaign", str(REPO / "campaigns" / "seed-ladder.yaml"),
          "--stage", "bogus"], "has no stage 'bogus'"),
        (["gates", str(ref), "--campaign", str(REPO / "campaigns" / "seed-ladder.yaml"),
          "--stage", "one-step"], "pass its promoted run with --reference"),
        (["gates", str(ref), "--reference", str(tmp_path / "missing")], "has no metrics.jsonl"),
    ]
    for args, message in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (args, res.output)
        assert message in res.output and res.output.count("\n") == 1, res.output


def test_diagnose_takes_its_thresholds_from_the_reference_given_or_recorded(tmp_path):
    """Issue 26 item 6 through the CLI, on the real `sync` history (the stress testbed's sync run,
    whose engine gap doubles: A on the seed's thresholds): against itself — given with
    --reference, or recorded in the run's gate_report.json as a campaign judged it — no cause."""
    from registry.gates import summarize
    from training.runtime.sinks import read_metrics

    hist = REPO / "tests" / "registry" / "histories" / "sync.jsonl"
    run = tmp_path / "sync"
    run.mkdir()
    (run / "metrics.jsonl").write_text(hist.read_text())
    plain = runner.invoke(app, ["diagnose", str(run), "--json"])
    assert plain.exit_code == 0 and json.loads(plain.stdout)["causes"] == ["A"]
    given = runner.invoke(app, ["diagnose", str(run), "--reference", str(hist), "--json"])
    out = json.loads(given.stdout)
    assert out["causes"] == [] and any("2.354" in line for line in out["calibration"])
    (run / "gate_report.json").write_text(json.dumps({"judged_with": {
        "campaign_id": "c", "stage": "one-step", "candidate": "x", "gates": [],
        "context": {"max_staleness": 0},
        "references": {"baseline": summarize(read_metrics(hist))}}}))
    recorded = runner.invoke(app, ["diagnose", str(run)])
    assert recorded.exit_code == 0, recorded.output
    assert "cause A" not in recorded.stdout
    assert "(thresholds calibrated on stage baseline's reference, as recorded" in recorded.stdout
    # a hand-edited gate_report.json whose reference is not a summary: diagnosed uncalibrated,
    # no traceback
    (run / "gate_report.json").write_text(json.dumps({"judged_with": {
        "gates": [], "context": "?", "references": {"baseline": [1, 2]}}}))
    odd = runner.invoke(app, ["diagnose", str(run), "--json"])
    assert odd.exit_code == 0 and json.loads(odd.stdout)["causes"] == ["A"], odd.output
