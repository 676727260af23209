"""A small campaign through the real stack: Prefect (temporary API), local Ray, embedded rollout
servers, MLflow on SQLite, the registry on SQLite — and checks on what it left behind.

Stage `baseline` runs one candidate; stage `async` runs `one-step` first, which must fail the
stage's gate (staleness bounded by 0, and one-step training is one step stale), then `sync`,
which passes: only `sync` is promoted and the failed candidate's gate report says why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

TINY = yaml.safe_load((Path(__file__).parents[1] / "tiny-recipe.yaml").read_text())

CAMPAIGN = {
    "name": "e2e",
    "base": TINY,
    "stages": [
        {"name": "baseline", "gates": [{"name": "reward_not_collapsed"},
                                       {"name": "staleness_within_bound"}]},
        {"name": "async",
         "candidates": [
             {"name": "one-step", "overrides": {"async": {"mode": "one_step"},
                                                "algorithm": {"old_logprob": "snapshot"}}},
             {"name": "sync", "overrides": {"optim": {"lr": 1e-5}},
              "description": "stay synchronous at a lower learning rate"},
         ],
         "description": "one step of lag, or none",
         "gates": [{"name": "staleness_within_bound", "params": {"max_staleness": 0}},
                   {"name": "logprob_diff_flat", "relative_to": "baseline",
                    "params": {"max_ratio": 5.0}}]},
    ],
}


# no candidate can pass: one-step training is one step stale and the gate allows none
STOPPING = {
    "name": "e2estop",
    "base": TINY,
    "stages": [{"name": "only",
                "candidates": [{"name": "one-step", "overrides": {
                    "async": {"mode": "one_step"}, "algorithm": {"old_logprob": "snapshot"}}}],
                "gates": [{"name": "staleness_within_bound", "params": {"max_staleness": 0}}]}],
}


EVENTS: dict[str, list] = {}  # progress events of each flow run of the fixture (the live table's)


@pytest.fixture(scope="module")
def campaign_run(tmp_path_factory, run_campaign):
    from flows.campaign import campaign_flow

    with run_campaign(tmp_path_factory, "e2e", CAMPAIGN) as (home, path):
        stop_path = home / "e2estop.yaml"
        stop_path.write_text(yaml.safe_dump(STOPPING))
        from flows.campaign import EVENT_LISTENERS

        runs = ("first", "again", "stopped")
        listeners = {r: EVENTS.setdefault(r, []).append for r in runs}
        EVENT_LISTENERS.append(listeners["first"])
        first = campaign_flow(str(path), "e2e-1")
        EVENT_LISTENERS[-1] = listeners["again"]
        again = campaign_flow(str(path), "e2e-1")  # a re-run: everything is already done
        EVENT_LISTENERS[-1] = listeners["stopped"]
        stopped = campaign_flow(str(stop_path), "e2e-stop", return_state=True)
        EVENT_LISTENERS.pop()
        yield home, first, again, stopped


def test_promotions_follow_the_gates(campaign_run):
    _, out, _, _ = campaign_run
    assert out.status == "finished", out.verdict
    assert out.promoted["baseline"].candidate == "default"
    assert out.promoted["async"].candidate == "sync"
    from registry.db import RegistryDB

    db = RegistryDB()
    promos = db.promotions(campaign_id="e2e-1")
    assert sorted((p.stage, p.candidate) for p in promos) == [("async", "sync"),
                                                                    ("baseline", "default")]
    runs = {(r.stage, r.candidate): r for r in db.runs("e2e-1")}
    assert set(runs) == {("baseline", "default"), ("async", "one-step"), ("async", "sync")}
    bad = {g.name: g for g in db.gate_results(runs[("async", "one-step")].id)}
    assert not bad["staleness_within_bound"].passed
    assert bad["staleness_within_bound"].value == 1.0
    assert "1" in bad["staleness_within_bound"].evidence
    assert runs[("async", "one-step")].status == "rejected"
    good = db.gate_results(runs[("async", "sync")].id)
    assert good and all(g.passed for g in good)
    # the async stage started from the baseline's promoted checkpoint
    recipe = yaml.safe_load(db.get_recipe(runs[("async", "sync")].recipe_hash).yaml)
    # ... known by the recipe that produced it (its identity does not depend on the path)
    assert recipe["model"] == {"kind": "checkpoint",
                               "path": out.promoted["baseline"].checkpoint,
                               "origin": f"recipe:{out.promoted['baseline'].recipe_hash}",
                               "moe_experts": 0}
    report = json.loads((Path(runs[("async", "one-step")].run_dir) / "gate_report.json")
                        .read_text())
    assert report["passed"] is False
    html = (Path(runs[("async", "one-step")].run_dir) / "gate_report.html").read_text()
    assert "<h2>gates of async/one-step: FAILED</h2>" in html
    assert "<tr class='fail'><td><code>staleness_within_bound</code></td><td><b>FAIL</b></td>" \
           "<td>1</td><td>0</td>" in html
    db.close()


def test_every_gate_and_the_diagnosis_run_on_the_real_metrics(campaign_run):
    from registry.db import RegistryDB
    from registry.gates import diagnosis_for, evaluate_gates, gate_names, summarize
    from training.runtime.sinks import read_metrics

    db = RegistryDB()
    run_dirs = [Path(r.run_dir) for r in db.runs("e2e-1")]
    db.close()
    assert len(run_dirs) == 3
    for run_dir in run_dirs:
        history = read_metrics(run_dir / "metrics.jsonl")
        assert len([r for r in history if not r.get("step/eval_only")]) == 2  # steps: 2
        results = evaluate_gates([(n, {}) for n in gate_names()], history,
                                 reference=summarize(history), context={"max_staleness": 1})
        assert [r.name for r in results] == gate_names() and len(results) == len(gate_names())
        for r in results:
            json.dumps(r.to_dict())
        by_name = {r.name: r for r in results}
        # sync and one-step runs are at most one step stale, the bound the context gives
        assert by_name["staleness_within_bound"].passed
        assert by_name["staleness_within_bound"].value in (0.0, 1.0)
        diagnosis = diagnosis_for(history)
        assert isinstance(diagnosis.causes, list)
        json.dumps(diagnosis.to_dict())


def test_mlflow_runs_metrics_artifacts_and_aliases(campaign_run):
    _, out, again, _ = campaign_run
    from mlflow import MlflowClient

    from flows.campaign import model_name
    from flows.tracking import default_tracking_uri

    client = MlflowClient(tracking_uri=default_tracking_uri(),
                          registry_uri=default_tracking_uri())
    exp = client.get_experiment_by_name("asyncrl/e2e")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("asyncrl.kind") == "campaign"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1  # the re-run continued it, no duplicate
    assert len(children) == 3
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        hist = client.get_metric_history(child.info.run_id, "rollout/reward_mean")
        assert [m.step for m in hist] == [0, 1]  # every step once, also after the re-run
        assert child.data.params["async.mode"] in ("sync", "one_step")
        arts = [a.path for a in client.list_artifacts(child.info.run_id, "plots")]
        assert any(p.endswith(".png") for p in arts)
        top = [a.path for a in client.list_artifacts(child.info.run_id)]
        assert "gate_report.json" in top and "gate_report.html" in top  # a table to read
    champion = client.get_model_version_by_alias(model_name("e2e"), "champion")
    staged = client.get_model_version_by_alias(model_name("e2e"), "stage-async")
    assert champion.version == staged.version
    sync_run = next(r for r in children if r.data.tags.get("asyncrl.candidate") == "sync")
    assert champion.run_id == sync_run.info.run_id
    assert again.promoted == out.promoted
    # MLflow 3 opens the experiment as model training, not in its GenAI evaluation view
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    # the promoted runs are tagged; the parent carries the champion, a description and each
    # stage's figures (step = the stage's index)
    promoted = {r.data.tags["asyncrl.candidate"] for r in children
                if r.data.tags.get("asyncrl.promoted") == "true"}
    assert promoted == {"default", "sync"}
    # each run says what it is for (the campaign file's descriptions)
    assert sync_run.data.tags["mlflow.note.content"] == (
        "stage async: one step of lag, or none\n"
        "candidate sync: stay synchronous at a lower learning rate")
    parent = client.get_run(parents[0].info.run_id)
    assert parent.data.tags["asyncrl.champion"] == "async/sync"
    assert parent.data.tags["mlflow.note.content"].startswith(
        "campaign e2e-1 (e2e): finished — all 2 stages promoted")
    assert "- baseline: promoted default (recipe " in parent.data.tags["mlflow.note.content"]
    for i, stage in enumerate(("baseline", "async")):
        hist = client.get_metric_history(parent.info.run_id, f"stage/{stage}/rollout_reward")
        assert [m.step for m in hist] == [i]
        assert parent.data.metrics[f"stage/{stage}/samples_trained"] > 0
    # the model version says what it is
    assert champion.description.startswith("campaign e2e-1, stage async: sync — first_passing")
    assert champion.tags["asyncrl.recipe_hash"] == out.promoted["async"].recipe_hash
    assert champion.tags["asyncrl.stage"] == "async"


def test_a_stopped_campaign_ends_failed_in_prefect_and_mlflow(campaign_run):
    """No passing candidate: the flow run is Failed with the verdict as its message (Prefect
    automations and alerts fire), the MLflow parent run is FAILED, the outcome is still read."""
    *_, state = campaign_run
    assert state.type.value == "FAILED"
    out = state.result(raise_on_failure=False)
    assert out.status == "stopped" and state.message == out.verdict
    assert "no candidate passed its gates (one-step: staleness_within_bound)" in out.verdict
    from mlflow import MlflowClient

    from flows.tracking import default_tracking_uri
    from registry.db import RegistryDB

    parent = MlflowClient(tracking_uri=default_tracking_uri()).get_run(out.mlflow_run_id)
    assert parent.info.status == "FAILED"
    assert parent.data.tags["asyncrl.verdict"] == out.verdict
    # the failing gate, with its value, limit and margin, for the outcome's last lines; the
    # registry's record gives the same notes (a run on a Prefect server reads them there)
    from flows.results import recorded_gate_notes

    failed = [n for n in out.gate_notes if not n.passed]
    assert [(n.stage, n.candidate, n.gate, n.value, n.threshold, n.margin) for n in failed] \
        == [("only", "one-step", "staleness_within_bound", 1.0, 0.0, 1.0)]
    db = RegistryDB()
    assert db.get_campaign("e2e-stop").status == "stopped"
    assert recorded_gate_notes(db, "e2e-stop") == out.gate_notes
    db.close()


def test_gates_command_rejudges_with_the_recorded_configuration(campaign_run):
    """`asyncrl gates RUN` on a candidate the campaign rejected reaches the campaign's verdict on
    every gate (its params, reference and context), and says which configuration it used."""
    from typer.testing import CliRunner

    from registry.db import RegistryDB
    from registry.gates import gate_names
    from ui.cli import app

    db = RegistryDB()
    runs = {(r.stage, r.candidate): r for r in db.runs("e2e-1")}
    run = runs[("async", "one-step")]
    recorded = {g.name: g for g in db.gate_results(run.id)}
    db.close()
    res = CliRunner().invoke(app, ["gates", run.run_dir, "--json"])
    assert res.exit_code == 3, res.output
    data = json.loads(res.stdout)
    assert "e2e-1/async/one-step" in data["judged_with"]
    got = {r["name"]: r for r in data["results"]}
    assert set(got) == set(recorded) == {"staleness_within_bound", "logprob_diff_flat"}
    for name, r in got.items():
        assert (r["passed"], r["value"], r["threshold"]) == (
            recorded[name].passed, recorded[name].value, recorded[name].threshold)
    assert got["staleness_within_bound"]["passed"] is False
    text = CliRunner().invoke(app, ["gates", run.run_dir]).stdout.splitlines()
    assert text[0].startswith("judged with the gates, parameters and context campaign run "
                              "e2e-1/async/one-step was judged with")
    assert "FAIL staleness_within_bound" in text[1] + text[2]
    # --defaults: every gate at its defaults, and the line says so
    res = CliRunner().invoke(app, ["gates", run.run_dir, "--defaults", "--json"])
    data = json.loads(res.stdout)
    assert data["judged_with"].startswith("every gate at its default parameters")
    assert len(data["results"]) == len(gate_names())


def test_the_flow_reports_its_progress_as_typed_events(campaign_run):
    """What `campaign launch`'s live table is drawn from, in the order it happened."""
    from flows.events import CandidateEvent, PromotedEvent, StageEvent, StepEvent

    # every trained run reports each step once, in order (what the table's state column and the
    # plain lines off a terminal show)
    steps: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for ev in EVENTS["first"]:
        if isinstance(ev, StepEvent):
            steps.setdefault((ev.stage, ev.candidate), []).append((ev.step, ev.total))
            assert ev.reward is None or 0.0 <= ev.reward <= 1.0
    assert set(steps) == {("baseline", "default"), ("async", "one-step"), ("async", "sync")}
    for got in steps.values():
        total = got[0][1]
        assert got == [(i, total) for i in range(1, total + 1)]

    def brief(ev):
        if isinstance(ev, StageEvent):
            return ("stage", ev.stage, ev.shown)
        if isinstance(ev, CandidateEvent):
            return ("candidate", ev.stage, ev.candidate, ev.status)
        assert isinstance(ev, PromotedEvent)
        return ("promoted", ev.stage, ev.candidate)

    shown = [e for e in EVENTS["first"] if not isinstance(e, StepEvent)]
    assert [brief(e) for e in shown] == [
        ("stage", "baseline", "running"),
        ("candidate", "baseline", "default", "running"),
        ("candidate", "baseline", "default", "passed"),
        ("promoted", "baseline", "default"),
        ("stage", "async", "running"),
        ("candidate", "async", "one-step", "running"),
        ("candidate", "async", "one-step", "rejected"),
        ("candidate", "async", "sync", "running"),
        ("candidate", "async", "sync", "passed"),
        ("promoted", "async", "sync")]
    judged = [e for e in EVENTS["first"] if isinstance(e, CandidateEvent) and e.status != "running"]
    assert all(e.gates and e.summary is not None and e.samples_trained for e in judged)
    # the re-run continues from the promotions: nothing trains
    assert [brief(e) for e in EVENTS["again"]] == [
        ("stage", "baseline", "promoted (earlier)"), ("stage", "async", "promoted (earlier)")]
    last = EVENTS["stopped"][-1]
    assert isinstance(last, StageEvent) and last.status == "failed" and last.verdict


def test_the_campaign_report_is_generated_from_the_records(campaign_run):
    """`asyncrl campaign report` (issue 26): every candidate's row with its gates' values and
    limits as recorded, the promotion with its reason, the evidence below."""
    from typer.testing import CliRunner

    from registry.db import RegistryDB
    from ui.cli import app

    db = RegistryDB()
    runs = {(r.stage, r.candidate): db.gate_results(r.id) for r in db.runs("e2e-1")}
    reason = next(p.reason for p in db.promotions(campaign_id="e2e-1") if p.stage == "async")
    db.close()
    res = CliRunner().invoke(app, ["campaign", "report", "e2e-1"])
    assert res.exit_code == 0, res.output
    text = res.output
    assert text.startswith("# Campaign `e2e-1` (e2e): finished")
    assert "## Stage 1: baseline (finished)" in text and "## Stage 2: async (finished)" in text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| candidate")}
    assert rows["one-step"].endswith("| failed |") and rows["sync"].endswith("| promoted |")
    stale = next(g for g in runs[("async", "one-step")] if g.name == "staleness_within_bound")
    assert f"✗ staleness_within_bound {stale.value:g} vs {stale.threshold:g}" in rows["one-step"]
    assert f"Promoted: **sync** — {reason}" in text
    assert f"- `one-step` FAIL `staleness_within_bound`: {stale.evidence}" in text
    bad = CliRunner().invoke(app, ["campaign", "report", "nope"])
    assert bad.exit_code == 1 and "no campaign 'nope'" in bad.output


def test_prefect_shows_the_campaign_by_name_with_tagged_tasks_and_stage_reports(campaign_run):
    """In the Prefect UI: the flow run is named after the campaign id, each task run after what
    it runs (``train|judge|promote <stage>/<candidate>``) with the campaign's and stage's tags,
    and each judged stage has a markdown artifact with its runs' gate verdicts and the
    promotion (the stopped campaign's says nothing passed)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=["e2e-1", "e2e-stop"])))
        assert sorted(r.name for r in runs) == ["e2e-1", "e2e-1", "e2e-stop"]
        first = min((r for r in runs if r.name == "e2e-1"), key=lambda r: r.created)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [first.id]}))
        names = sorted(t.name for t in tasks)
        assert names == sorted([
            "train baseline/default", "judge baseline/default", "promote baseline/default",
            "train async/one-step", "judge async/one-step",
            "train async/sync", "judge async/sync", "promote async/sync"])
        for t in tasks:
            stage = t.name.split(" ")[1].split("/")[0]
            assert {"asyncrl", "campaign:e2e", f"stage:{stage}"} <= set(t.tags)
        arts = {a.key: a for a in client.read_artifacts()
                if a.key in ("e2e-1-baseline", "e2e-1-async", "e2e-stop-only")}
    assert set(arts) == {"e2e-1-baseline", "e2e-1-async", "e2e-stop-only"}
    assert all(a.type == "markdown" for a in arts.values())
    md = arts["e2e-1-async"].data
    assert md.splitlines()[2] == "one step of lag, or none"  # the stage's description
    assert "**Promoted:** `sync` (recipe `" in md and "first_passing: passed 2 gates" in md
    assert "| `one-step` | rejected |" in md and "| `sync` | promoted |" in md
    row = next(line for line in md.splitlines()
               if line.startswith("| `staleness_within_bound` | **fail**"))
    assert "| 1 | 0 |" in row  # one step stale, none allowed
    assert "**No candidate passed its gates.**" in arts["e2e-stop-only"].data


def test_the_dashboard_in_a_browser(campaign_run, browser, dashboard_server):
    """The campaign this module ran, as a researcher sees it in the dashboard (Debian's chromium,
    headless): the list, the ladder with the failed gate and its evidence, the promoted candidate
    marked, every link on the page answering, then the failed candidate's diagnostics — charts
    drawn as SVG, the recipe diff, the diagnosis. A page that logs a JavaScript error fails.
    Screenshots: the test's artifacts (and docs/images with ASYNCRL_SCREENSHOT_DIR)."""
    import httpx
    from selenium.webdriver.common.by import By

    from registry.db import RegistryDB

    home = campaign_run[0]
    db = RegistryDB()
    runs = {(r.stage, r.candidate): r for r in db.runs("e2e-1")}
    db.close()
    with dashboard_server(home) as url:
        d = browser.open(url + "/", wait_for="#campaigns")
        rows = {r.find_element(By.CSS_SELECTOR, "td a").text: r.text
                for r in d.find_elements(By.CSS_SELECTOR, "#campaigns tbody tr")}
        assert set(rows) == {"e2e-1", "e2e-stop"}
        assert "finished" in rows["e2e-1"] and "async/sync" in rows["e2e-1"]
        assert "stopped" in rows["e2e-stop"]

        d = browser.open(f"{url}/campaign/e2e-1", wait_for=".cell")
        failed = d.find_element(By.CSS_SELECTOR, ".cell[data-candidate='one-step']")
        assert "failed" in failed.get_attribute("class").split()
        gate = failed.find_element(By.CSS_SELECTOR, "tr.gate.fail")
        assert gate.get_attribute("data-gate") == "staleness_within_bound"
        cells = [td.text for td in gate.find_elements(By.TAG_NAME, "td")]
        assert cells[2:] == ["1", "0", "1"]  # value, limit, margin
        evidence = failed.find_element(By.CSS_SELECTOR, "tr.evidence.fail").text
        assert "peaked at 1" in evidence
        promoted = d.find_element(By.CSS_SELECTOR, ".cell[data-candidate='sync']")
        assert "promoted" in promoted.get_attribute("class").split()
        assert "★ promoted" in promoted.text and "first_passing" in promoted.text
        assert len(d.find_elements(By.CSS_SELECTOR, ".cell.promoted")) == 2  # one per stage
        hrefs = {a.get_attribute("href") for a in d.find_elements(By.CSS_SELECTOR, "a[href]")}
        assert f"{url}/campaign/e2e-1/run/{runs[('async', 'one-step')].id}" in hrefs
        for href in hrefs:  # the run pages, run directories and navigation all answer
            assert httpx.get(href, timeout=60).status_code == 200, href
        browser.shot("dashboard-ladder.png")

        one_step = runs[("async", "one-step")]
        d = browser.open(f"{url}/campaign/e2e-1/run/{one_step.id}", wait_for=".chart .main-svg")
        charts = d.find_elements(By.CSS_SELECTOR, ".chart")
        assert len(charts) >= 8
        for chart in charts:  # each drew an SVG with its data traces
            assert chart.find_elements(By.CSS_SELECTOR, "svg.main-svg"), \
                chart.get_attribute("id")
            assert chart.find_elements(By.CSS_SELECTOR, ".scatterlayer .trace, .barlayer .trace"), \
                chart.get_attribute("id")
        ids = {c.get_attribute("id") for c in charts}
        assert {"chart-logprob", "chart-staleness", "chart-entropy", "chart-reward",
                "chart-is-engine-ess", "chart-is-staleness-mask_frac"} <= ids
        legend = d.find_element(By.ID, "chart-logprob").text
        assert "one-step" in legend and "sync" in legend and "reference" in legend
        diff = {tr.find_element(By.TAG_NAME, "code").text: tr.text
                for tr in d.find_elements(By.CSS_SELECTOR, "#recipe-diff tbody tr")}
        assert '"sync" "one_step"' in diff["async.mode"]
        assert "promoted checkpoint" in diff["model"]
        assert d.find_elements(By.CSS_SELECTOR, "#diagnosis .finding")
        # the rollouts the run kept: the step's largest-|Δlogp| and highest-reward trajectories,
        # tokens coloured by |Δlogp| (the hottest full red), the staleness of each token shown
        rollouts = d.find_elements(By.CSS_SELECTOR, "#rollouts .rollout")
        assert len(rollouts) == 4  # 2 steps × 2 trajectories
        assert "largest |Δlogp|" in rollouts[0].text and "highest reward" in rollouts[1].text
        toks = rollouts[0].find_elements(By.CSS_SELECTOR, ".tok")
        assert toks and all("staleness" in t.get_attribute("title") for t in toks)
        shades = {t.value_of_css_property("background-color") for t in toks}
        assert len(shades) > 1
        browser.shot("dashboard-diagnostics.png")
        assert not browser.errors()

        # a run the registry does not know: a page that says so, not a traceback
        r = httpx.get(f"{url}/campaign/e2e-1/run/999999", timeout=30)
        assert r.status_code == 404 and "has no run 999999" in r.text
        # a path out of the run directory (encoded, so no client resolves it first) is refused
        r = httpx.get(f"{url}/run/e2e-1/{one_step.id}/files/%2e%2e/%2e%2e/%2e%2e/registry.db",
                      timeout=30)
        assert r.status_code == 404 and "outside the run directory" in r.text
        r = httpx.get(f"{url}/run/e2e-1/{one_step.id}/files/gate_report.html", timeout=30)
        assert r.status_code == 200 and r.headers["content-security-policy"] == "sandbox"
        # a Host header other than the loopback's (DNS rebinding) is refused
        assert httpx.get(f"{url}/", headers={"Host": "evil.example"},
                         timeout=30).status_code == 400
