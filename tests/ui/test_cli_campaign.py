"""`asyncrl campaign …` / `registry …` / `gates` / `diagnose` / `schema campaign`: malformed
campaign files each give one `error:` line and a non-zero exit, never a traceback; the read-only
commands work on a registry and a run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ui.cli import app

runner = CliRunner()

GOOD = {
    "name": "c",
    "base": {"steps": 2},
    "stages": [{"name": "baseline", "gates": [{"name": "reward_not_collapsed"}]},
               {"name": "next", "overrides": {"async": {"mode": "one_step"}},
                "gates": [{"name": "logprob_diff_flat", "relative_to": "baseline"}]}],
}


def _with(path: str, value):
    """GOOD with one field replaced (dotted path; list indices as numbers)."""
    data = json.loads(json.dumps(GOOD))
    node = data
    parts = path.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


BAD: list[tuple[str, object]] = [
    # top level
    ("not a mapping", ["a", "b"]),
    ("scalar", 42),
    ("missing name", {k: v for k, v in GOOD.items() if k != "name"}),
    ("missing base", {k: v for k, v in GOOD.items() if k != "base"}),
    ("missing stages", {k: v for k, v in GOOD.items() if k != "stages"}),
    ("empty stages", _with("stages", [])),
    ("unknown top field", {**GOOD, "stagez": []}),
    ("name with spaces", _with("name", "my campaign")),
    ("name too long", _with("name", "x" * 80)),
    ("name wrong type", _with("name", ["a"])),
    ("stages wrong type", _with("stages", "baseline")),
    ("base wrong type", _with("base", 3)),
    ("base missing file", _with("base", "no/such/recipe.yaml")),
    # stages
    ("stage missing name", _with("stages.0", {"gates": []})),
    ("stage unknown field", _with("stages.0", {"name": "a", "gatez": []})),
    ("duplicate stage names", _with("stages.1.name", "baseline")),
    ("stage name bad chars", _with("stages.0.name", "base line!")),
    ("stage steps zero", _with("stages.0", {"name": "a", "steps": 0})),
    ("stage steps negative", _with("stages.0", {"name": "a", "steps": -3})),
    ("stage steps string", _with("stages.0", {"name": "a", "steps": "many"})),
    ("unknown promotion rule", _with("stages.0", {"name": "a", "promotion": "best"})),
    ("empty candidates", _with("stages.0", {"name": "a", "candidates": []})),
    ("duplicate candidates", _with("stages.0", {"name": "a", "candidates": [
        {"name": "x"}, {"name": "x"}]})),
    ("candidate unknown field", _with("stages.0", {"name": "a", "candidates": [
        {"name": "x", "override": {}}]})),
    ("candidate bad name", _with("stages.0", {"name": "a", "candidates": [{"name": "x y"}]})),
    ("overrides wrong type", _with("stages.0", {"name": "a", "overrides": [1, 2]})),
    # gates
    ("unknown gate", _with("stages.0.gates", [{"name": "no_such_gate"}])),
    ("gate unknown param", _with("stages.0.gates", [{"name": "reward_not_collapsed",
                                                     "params": {"dropp": 0.3}}])),
    ("gate param wrong type", _with("stages.0.gates", [{"name": "reward_not_collapsed",
                                                        "params": {"drop": "lots"}}])),
    ("gate param out of range", _with("stages.0.gates", [{"name": "reward_not_collapsed",
                                                          "params": {"drop": 7}}])),
    ("gate missing name", _with("stages.0.gates", [{"params": {}}])),
    ("gate unknown field", _with("stages.0.gates", [{"name": "is_health", "when": "always"}])),
    ("relative_to unknown stage", _with("stages.1.gates", [
        {"name": "logprob_diff_flat", "relative_to": "nope"}])),
    ("relative_to itself", _with("stages.1.gates", [
        {"name": "logprob_diff_flat", "relative_to": "next"}])),
    ("relative_to later stage", _with("stages.0.gates", [
        {"name": "logprob_diff_flat", "relative_to": "next"}])),
    ("gates wrong type", _with("stages.0.gates", "all")),
    # recipes built from the overrides
    ("unknown loss", _with("stages.1.overrides", {"algorithm": {"loss": {"name": "ppo2"}}})),
    ("unknown advantage", _with("stages.1.overrides", {"algorithm": {"advantage": {
        "estimator": "gae2"}}})),
    ("unknown preset", _with("stages.1.overrides", {"algorithm": {"correction": {
        "kind": "preset", "name": "magic"}}})),
    ("unknown correction kind", _with("stages.1.overrides", {"algorithm": {"correction": {
        "kind": "fancy"}}})),
    ("unknown async mode", _with("stages.1.overrides", {"async": {"mode": "turbo"}})),
    ("negative staleness", _with("stages.1.overrides", {"async": {
        "mode": "fully_async", "staleness_threshold": -1}})),
    ("r3 on dense", _with("stages.1.overrides", {"algorithm": {"routing_replay": "r3"}})),
    ("icepop bounds swapped", _with("stages.1.overrides", {"algorithm": {"correction": {
        "kind": "compis", "engine": {"method": "icepop", "lower": 5, "upper": 0.5}}}})),
    ("compis with bypass", _with("stages.1.overrides", {"algorithm": {
        "old_logprob": "bypass", "correction": {"kind": "compis"}}})),
    ("one_step drops everything", _with("stages.1.overrides", {"async": {
        "mode": "one_step", "max_off_policy_steps": 0}})),
    ("unknown recipe field", _with("stages.1.overrides", {"optimizer": {"lr": 1}})),
    ("lr negative", _with("stages.1.overrides", {"optim": {"lr": -1}})),
    ("group size zero", _with("stages.1.overrides", {"rollout": {"n": 0}})),
    ("temperature zero", _with("stages.1.overrides", {"rollout": {"temperature": 0}})),
    ("unknown task", _with("stages.1.overrides", {"task": {"name": "chess"}})),
    ("unknown KL estimator", _with("stages.1.overrides", {"algorithm": {"kl": {
        "estimator": "k9"}}})),
    ("candidate bad override", _with("stages.1", {"name": "next", "candidates": [
        {"name": "a"}, {"name": "b", "overrides": {"rollout": {"top_p": 2}}}]})),
    ("base recipe invalid", _with("base", {"steps": 0})),
    ("base recipe unknown field", _with("base", {"stepz": 2})),
    # the file itself (bytes are written as they are)
    ("not UTF-8", yaml.safe_dump(GOOD).encode().replace(b"baseline", b"base\xe9line", 1)),
    ("UTF-16", yaml.safe_dump(GOOD).encode("utf-16")),
    ("control character", yaml.safe_dump(GOOD).encode().replace(b"name: c", b"name: c\x07", 1)),
    ("duplicate key", b"name: c\nbase: {steps: 2}\nname: d\nstages: [{name: a}]\n"),
    ("duplicate nested key", b"name: c\nbase: {steps: 2}\nstages:\n- name: a\n  name: b\n"),
    ("unsafe tag", b"name: !!python/object/apply:os.system [echo hi]\n"),
]


@pytest.mark.parametrize("label,data", BAD, ids=[b[0] for b in BAD])
def test_malformed_campaigns_fail_in_one_line(tmp_path, label, data):
    path = tmp_path / "c.yaml"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(yaml.safe_dump(data))
    res = runner.invoke(app, ["campaign", "launch", str(path)])
    assert res.exit_code != 0, label
    assert res.exception is None or isinstance(res.exception, SystemExit), label
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (label, res.stderr)
    assert "Traceback" not in res.output


@pytest.mark.parametrize("text", ["stages: [\n", "name: a\n  base: b\n", "\t- x", "a: b: c"])
def test_bad_yaml_names_the_line(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    res = runner.invoke(app, ["campaign", "launch", str(path)])
    assert res.exit_code == 1
    assert res.stderr.startswith("error: ") and "YAML" in res.stderr


@pytest.mark.parametrize(("data", "needle"), [
    (b"name: caf\xe9\n", "line 1 is not UTF-8 text (byte 0xe9 at offset 9); save it as UTF-8"),
    (b"name: c\nbase: \x07\n",
     "line 2, column 7 is not valid YAML (character U+0007 is not allowed in YAML); remove it"),
    (b"name: c\nbase: {steps: 2}\nname: d\n",
     "line 3: key 'name' appears twice in the same mapping (first at line 1); remove one"),
])
def test_bad_file_names_the_problem_and_the_fix(tmp_path, data, needle):
    path = tmp_path / "c.yaml"
    path.write_bytes(data)
    res = runner.invoke(app, ["campaign", "launch", str(path)])
    assert res.exit_code == 1
    assert res.stderr == f"error: {path}: {needle}\n"


def test_missing_campaign_file(tmp_path):
    res = runner.invoke(app, ["campaign", "launch", str(tmp_path / "nope.yaml")])
    assert res.exit_code == 1 and "does not exist" in res.stderr


def test_shipped_campaigns_validate():
    from registry.campaign import load_campaign

    root = Path(__file__).resolve().parents[2] / "campaigns"
    files = sorted(root.glob("*.yaml"))
    assert any(f.name == "quick.yaml" for f in files)
    for f in files:
        campaign, base = load_campaign(f)
        assert campaign.stages and base.hash()


def test_schema_campaign():
    res = runner.invoke(app, ["schema", "campaign"])
    assert res.exit_code == 0
    schema = json.loads(res.stdout)
    assert {"name", "base", "stages"} <= set(schema["properties"])


def test_registry_commands_on_an_empty_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ASYNCRL_REGISTRY_URL", raising=False)
    assert runner.invoke(app, ["campaign", "list", "--json"]).stdout.strip() == "[]"
    res = runner.invoke(app, ["campaign", "status"])
    assert res.exit_code == 1 and "no campaigns yet" in res.stderr
    res = runner.invoke(app, ["campaign", "resume", "nope"])
    assert res.exit_code == 1 and "no campaign 'nope'" in res.stderr
    res = runner.invoke(app, ["registry", "show", "abc"])
    assert res.exit_code == 1 and "no recipe" in res.stderr
    res = runner.invoke(app, ["registry", "retire", "7", "--reason", "x"])
    assert res.exit_code == 1 and res.stderr.startswith("error: ")


def test_gates_and_diagnose_on_a_run_directory(tmp_path):
    rows = [{"step": s, "rollout/reward_mean": 0.5, "mismatch/train_rollout/logprob_abs_diff/mean":
             0.005 + 0.01 * s, "policy/entropy/mean": 0.2, "async/staleness/max": 0}
            for s in range(8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(app, ["gates", str(tmp_path), "--gate", "logprob_diff_flat"])
    assert res.exit_code == 3  # a failing gate
    first, second = res.stdout.splitlines()[:2]
    assert first.startswith("judged with default parameters (no gate_report.json")
    assert second.startswith("FAIL logprob_diff_flat")
    res = runner.invoke(app, ["gates", str(tmp_path), "--gate", "reward_not_collapsed",
                              "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["results"][0]["passed"] is True
    # no mismatch/engine/* logged: the rise cannot be attributed, so no cause A is invented
    res = runner.invoke(app, ["diagnose", str(tmp_path), "--json"])
    diag = json.loads(res.stdout)
    assert res.exit_code == 0 and diag["causes"] == []
    assert diag["unseparated"]["override"] == {"algorithm.old_logprob": "snapshot"}
    res = runner.invoke(app, ["gates", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "no metrics.jsonl" in res.stderr


def test_diagnose_prints_cause_b_and_an_override_that_loads(tmp_path):
    from training.recipe import apply_overrides, load_recipe, recipe_from_dict

    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "one_step.yaml")
    (tmp_path / "recipe.yaml").write_text(recipe.to_yaml())
    # snapshot, one-step: the exact engine gap flat at 0.006, π_current drifting away from μ
    rows = [{"step": s, "mismatch/train_rollout/logprob_abs_diff/mean": 0.006 + 0.002 * s,
             "mismatch/engine/logprob_abs_diff/mean": 0.006, "mismatch/engine/exact": 1.0,
             "is/staleness/kl_k1": 0.01 + 0.002 * s} for s in range(12)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(app, ["diagnose", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "cause B: policy staleness" in out and "cause A" not in out
    # the staleness KL grows (0.01 → 0.032; last/first quarter 0.03 / 0.012 = 2.5 > 1.5):
    # seed 001's B, with its level over the healthy bound as evidence (last quarter 0.03)
    assert "  evidence: is/staleness/kl_k1 = 0.03 > 0.02" in out
    assert "  evidence: is/staleness/kl_k1 last/first quarter = 2.5 > 1.5" in out
    # the indented YAML block after the header is the override, ready to paste
    block = out.split("prescribed override (paste into a campaign candidate):\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if not line.startswith("    "):
            break
        lines.append(line[4:])
    override = yaml.safe_load("\n".join(lines))["overrides"]
    assert override == {"algorithm.correction": {
        "kind": "preset", "name": "decoupled_geo_rs_seq_tis",
        "args": {"is_threshold": 2.0, "rs_threshold": "0.99_1.01"}}}
    fixed = recipe_from_dict(apply_overrides(recipe.to_dict(), override))
    assert fixed.algorithm.correction.name == "decoupled_geo_rs_seq_tis"
    assert "warning" not in out and "not tailored" not in out
    diag = json.loads(runner.invoke(app, ["diagnose", str(tmp_path), "--json"]).stdout)
    assert diag["causes"] == ["B"] and diag["recipe"] == "recipe.yaml"
    assert diag["findings"][0]["override_error"] is None


def test_off_a_terminal_each_event_is_one_plain_line_with_names_whole():
    """`campaign launch > log` (CI, nohup, a scheduler): no live table, one line per event —
    names whole however long, progress by tenths of a run's steps, a rejection with its failed
    gates' values and limits, the warm start's progress by tenths."""
    import io
    import re

    from flows.events import CandidateEvent, PromotedEvent, StageEvent, StepEvent
    from registry.gates import GateResult
    from ui.campaign_cli import _EventLines

    out = io.StringIO()
    lines = _EventLines(out)
    stage, cand = "baseline-with-a-long-stage-name", "candidate-with-a-long-name"
    failed = GateResult("eval_not_degraded", False, 0.3125, 0.45, (0, 19), "eval fell", {})
    passed = GateResult("reward_not_collapsed", True, 0.5, 0.05, (0, 19), "fine", {})
    for text in ["train 1/700", "train 69/700", "train 70/700", "train 71/700",
                 "train 700/700", None]:
        lines.report(text)
    lines(StageEvent(stage, "running"))
    lines(CandidateEvent(stage, cand, "running", recipe_hash="0123456789abcdef"))
    for step in range(1, 21):
        lines(StepEvent(stage, cand, step, 20, reward=0.25 if step < 20 else None))
    lines(CandidateEvent(stage, cand, "rejected", summary={
        "rollout/reward_mean": 0.41, "eval/reward_mean": 0.3125}, gates=[passed, failed]))
    lines(CandidateEvent(stage, "other", "passed", summary={"rollout/reward_mean": 0.5},
                         gates=[passed]))
    lines(PromotedEvent(stage, "other"))
    lines(StageEvent("next", "failed", verdict="no candidate passed"))
    got = out.getvalue().splitlines()
    assert all(re.match(r"^\d\d:\d\d:\d\d ", line) for line in got)
    assert [line[9:] for line in got] == [
        "warm start: train 1/700",
        "warm start: train 70/700",  # a new tenth
        "warm start: train 700/700",
        "warm start: done",
        f"stage {stage}: running",
        f"{stage}/{cand}: running (recipe 0123456789abcdef)",
        f"{stage}/{cand}: step 2/20, rollout reward 0.25",
        *[f"{stage}/{cand}: step {s}/20, rollout reward 0.25" for s in range(4, 20, 2)],
        f"{stage}/{cand}: step 20/20",
        f"{stage}/{cand}: rejected (reward 0.41; eval 0.312); failed eval_not_degraded "
        "(value 0.312, limit 0.45)",
        f"{stage}/other: passed (reward 0.5)",
        f"stage {stage}: promoted other",
        "stage next: failed — no candidate passed",
    ]


def test_a_recipe_hash_prefix_names_the_recipe_it_alone_starts(tmp_path, monkeypatch):
    """Tables print hashes shortened: `registry show` (SQLite read without SQLAlchemy) and
    `registry promote` (RegistryDB) take a unique prefix of 4+ characters; an ambiguous, short
    or unknown one is a one-line error naming the fix."""
    from registry.db import RegistryDB

    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ASYNCRL_REGISTRY_URL", raising=False)
    (tmp_path / "home").mkdir()
    with RegistryDB() as db:
        for h in ("abcd111111111111", "abcd222222222222", "ef01333333333333"):
            db.put_recipe(h, f"r-{h[:4]}", "steps: 2\n")
    res = runner.invoke(app, ["registry", "show", "EF01"])
    assert res.exit_code == 0 and res.stdout.startswith("# recipe ef01333333333333 (r-ef01)")
    res = runner.invoke(app, ["registry", "show", "abcd1"])
    assert res.exit_code == 0 and "abcd111111111111" in res.stdout.splitlines()[0]
    refused = {
        "abcd": "recipe hash prefix 'abcd' matches abcd111111111111, abcd222222222222; give "
                "more characters",
        "abc": "no recipe 'abc' in the registry; give at least 4 characters of its hash "
               "(`asyncrl registry list` shows the promoted ones)",
        "ffff": "no recipe 'ffff' in the registry; `asyncrl registry list` shows the promoted "
                "ones",
        "ab%_": "no recipe 'ab%_' in the registry; `asyncrl registry list` shows the promoted "
                "ones",
    }
    for text, message in refused.items():
        res = runner.invoke(app, ["registry", "show", text])
        assert (res.exit_code, res.stderr) == (1, f"error: {message}\n"), text
    res = runner.invoke(app, ["registry", "promote", "abcd2", "--reason", "by hand"])
    assert res.exit_code == 0 and res.stdout.strip().endswith(": abcd222222222222")
    res = runner.invoke(app, ["registry", "promote", "abcd", "--reason", "by hand"])
    assert res.exit_code == 1 and "matches abcd111111111111, abcd222222222222" in res.stderr
