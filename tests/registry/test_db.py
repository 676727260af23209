"""The SQL registry (registry/db.py, registry/models.py, registry/migrations) on SQLite and on a
real PostgreSQL server (tests/conftest.py starts one): migrations, every API method with
real values, idempotency of the writes a resumed campaign repeats, concurrency, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import FrozenInstanceError, fields
from datetime import datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from registry.db import (
    SCHEMA_HEAD,
    CampaignRecord,
    GateRecord,
    OwnerRecord,
    PromotionRecord,
    RecipeRecord,
    RegistryDB,
    RegistryError,
    RunRecord,
    StageRecord,
    default_url,
    head_revision,
    open_existing,
)
from registry.models import Base
from training.ownership import ProcessIdentity

TABLES = {"campaigns", "stages", "recipes", "candidate_runs", "gate_results", "promotions",
          "campaign_owners", "remediations"}
SPEC = {"name": "ladder", "stages": [{"name": "sync", "candidates": ["a", "b"]}], "lr": 2e-4}
HASH_A = "a" * 64
HASH_B = "b" * 64


@pytest.fixture
def db(db_url):
    registry = RegistryDB(db_url)
    yield registry
    registry.close()


@pytest.fixture
def campaign(db):
    """A campaign with a recipe and one stage recorded."""
    db.create_campaign("c1", "ladder", SPEC)
    db.put_recipe(HASH_A, "base", "model: tiny\nsteps: 10\n")
    db.put_recipe(HASH_B, "base+one_step", "model: tiny\nsteps: 10\nasync: one_step\n")
    db.upsert_stage("c1", "sync", 0, "running")
    return "c1"


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


# ---- migrations -------------------------------------------------------------------------------


def test_migrations_create_every_table_at_head(db_url):
    db = RegistryDB(db_url)
    try:
        assert _tables(db_url) == TABLES | {"alembic_version"}
        assert db.schema_revision() == head_revision() == "0005"
        columns = {c["name"] for c in inspect(db._engine).get_columns("promotions")}
        assert {"retired_at", "retired_by", "retire_reason", "recipe_hash"} <= columns
    finally:
        db.close()


def test_models_match_the_migrated_schema(db):
    """The ORM models and the hand-written migrations describe the same schema."""
    with db._engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diffs == []


def test_downgrade_base_then_upgrade_head(db, db_url, campaign):
    db.downgrade("0001")
    assert db.schema_revision() == "0001"
    columns = {c["name"] for c in inspect(db._engine).get_columns("promotions")}
    assert "retired_at" not in columns
    assert db.get_campaign("c1").name == "ladder"  # data survives a one-step downgrade
    db.downgrade("base")
    assert db.schema_revision() == ""
    assert _tables(db_url) & TABLES == set()
    db.upgrade()
    assert db.schema_revision() == head_revision()
    assert _tables(db_url) == TABLES | {"alembic_version"}
    db.create_campaign("c2", "again", SPEC)  # usable after the round trip
    assert [c.id for c in db.list_campaigns()] == ["c2"]


def test_upgrade_false_leaves_an_empty_database_alone(db_url):
    db = RegistryDB(db_url, upgrade=False)
    try:
        assert db.schema_revision() == ""
        assert _tables(db_url) == set()
    finally:
        db.close()
    db = RegistryDB(db_url)  # and opening it normally migrates it
    try:
        assert db.schema_revision() == head_revision()
    finally:
        db.close()


def test_schema_head_is_the_newest_migration():
    """SCHEMA_HEAD lets a registry at head open without Alembic; a new migration must move it."""
    assert head_revision() == SCHEMA_HEAD


def test_a_registry_behind_head_still_migrates_on_open(db, db_url, campaign):
    db.downgrade("0002")
    db.close()
    again = RegistryDB(db_url)
    try:
        assert again.schema_revision() == head_revision()
        assert again.get_campaign("c1").name == "ladder"
    finally:
        again.close()


def test_a_registry_at_head_opens_without_alembic(tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    RegistryDB(url).close()
    code = (f"import sys; from registry.db import RegistryDB; db = RegistryDB({url!r}); "
            "db.create_campaign('c', 'n', {}); print(db.get_campaign('c').name, "
            "'alembic' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["n", "False"]


def test_open_existing_creates_nothing(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'state' / 'registry.db'}"
    assert open_existing(url) is None
    assert not (tmp_path / "state").exists()
    monkeypatch.delenv("ASYNCRL_REGISTRY_URL", raising=False)
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))
    assert open_existing() is None and not (tmp_path / "home").exists()
    RegistryDB(url).close()  # the first write's open creates and migrates it
    with open_existing(url) as db:
        assert db.schema_revision() == head_revision()


def test_open_existing_opens_a_server_registry(postgres_db):
    with open_existing(postgres_db) as db:  # a fresh database: migrated
        assert db.schema_revision() == head_revision()
        db.create_campaign("c1", "ladder", SPEC)
    with open_existing(postgres_db) as db:  # at head: one query, no migration
        assert [c.id for c in db.list_campaigns()] == ["c1"]


def test_two_registries_opening_a_fresh_database_at_once(db_url):
    """Two processes' first open both migrate: one waits for the other, neither fails."""
    errors, dbs = [], []

    def open_it():
        try:
            dbs.append(RegistryDB(db_url))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_it) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for d in dbs:
        d.close()
    assert errors == []
    assert len(dbs) == 2


# ---- campaigns and stages ---------------------------------------------------------------------


def test_campaign_create_get_list_and_status(db):
    assert db.get_campaign("nope") is None
    db.create_campaign("c1", "ladder", SPEC)
    c = db.get_campaign("c1")
    assert c.id == "c1" and c.name == "ladder" and c.spec == SPEC
    assert c.status == "pending" and c.verdict is None and c.diagnosis is None
    assert c.created_at.endswith("+00:00")
    json.dumps(c.to_dict())  # a JSON-ready dict

    db.create_campaign("c1", "ladder", json.loads(json.dumps(SPEC)))  # same again: no-op
    assert db.get_campaign("c1") == c
    with pytest.raises(RegistryError, match="different name or spec"):
        db.create_campaign("c1", "ladder", {**SPEC, "lr": 1e-3})

    db.create_campaign("c0", "other", {"x": 1})
    assert [x.id for x in db.list_campaigns()] == ["c1", "c0"]

    db.set_campaign_status("c1", "running")
    assert db.get_campaign("c1").status == "running"
    diagnosis = {"causes": [{"id": "C", "evidence": {"mismatch/k3_kl": 0.02}}]}
    db.set_campaign_status("c1", "stopped", verdict="no candidate passed stage sync",
                           diagnosis=diagnosis)
    c = db.get_campaign("c1")
    assert (c.status, c.verdict, c.diagnosis) == (
        "stopped", "no candidate passed stage sync", diagnosis)
    assert c.updated_at >= c.created_at
    db.set_campaign_status("c1", "running")  # verdict and diagnosis kept unless given
    assert db.get_campaign("c1").verdict == "no candidate passed stage sync"
    with pytest.raises(RegistryError, match="unknown campaign status 'done'"):
        db.set_campaign_status("c1", "done")
    with pytest.raises(RegistryError, match="no campaign 'zz'"):
        db.set_campaign_status("zz", "running")
    with pytest.raises(RegistryError, match="JSON"):
        db.create_campaign("c9", "bad", {"x": object()})


def test_stages(db, campaign):
    db.upsert_stage(campaign, "fully_async", 2, "pending")
    db.upsert_stage(campaign, "one_step", 1, "pending")
    before = db.stages(campaign)
    assert [(s.name, s.index, s.status) for s in before] == [
        ("sync", 0, "running"), ("one_step", 1, "pending"), ("fully_async", 2, "pending")]
    db.upsert_stage(campaign, "one_step", 1, "pending")  # same again: nothing changes
    assert db.stages(campaign) == before
    db.upsert_stage(campaign, "sync", 0, "finished")
    assert db.stages(campaign)[0].status == "finished"
    assert db.stages(campaign)[0].promoted_candidate is None
    with pytest.raises(RegistryError, match="unknown stage status"):
        db.upsert_stage(campaign, "sync", 0, "great")
    with pytest.raises(RegistryError, match="create_campaign first"):
        db.upsert_stage("missing", "sync", 0, "pending")
    assert db.stages("missing") == []


# ---- recipes and runs -------------------------------------------------------------------------


def test_recipes(db):
    assert db.get_recipe(HASH_A) is None
    db.put_recipe(HASH_A, "base", "model: tiny\n")
    r = db.get_recipe(HASH_A)
    assert (r.hash, r.name, r.yaml) == (HASH_A, "base", "model: tiny\n")
    db.put_recipe(HASH_A, "base", "model: tiny\n")
    assert db.get_recipe(HASH_A) == r
    # what a shortened hash resolves to (the CLI's prefixes), on SQLite and PostgreSQL alike
    db.put_recipe("ab12" + HASH_A[4:], "other", "model: tiny\n")
    assert db.recipe_hashes(HASH_A[:6]) == [HASH_A]
    assert db.recipe_hashes("") == sorted([HASH_A, "ab12" + HASH_A[4:]])
    assert db.recipe_hashes("%") == [] and db.recipe_hashes("zz") == []


def test_runs(db, campaign):
    run_id = db.upsert_run(campaign, "sync", "a", HASH_A)
    assert db.upsert_run(campaign, "sync", "a", HASH_A) == run_id  # same id, nothing changed
    r = db.get_run(run_id)
    assert r.status == "pending" and r.started_at is None and r.summary is None
    assert db.get_run(campaign_id=campaign, stage="sync", candidate="a") == r

    db.upsert_run(campaign, "sync", "a", HASH_A, status="running", run_dir="/runs/c1/sync/a",
                  mlflow_run_id="abc123")
    r = db.get_run(run_id)
    assert (r.status, r.run_dir, r.mlflow_run_id) == (
        "running", "/runs/c1/sync/a", "abc123")
    assert r.started_at is not None and r.finished_at is None

    summary = {"steps": 10, "reward": {"mean": 0.47}, "checkpoint": "/runs/c1/sync/a/final"}
    db.upsert_run(campaign, "sync", "a", HASH_A, status="finished", summary=summary)
    done = db.get_run(run_id)
    assert done.summary == summary and done.finished_at is not None
    assert done.run_dir == "/runs/c1/sync/a"  # fields not given are kept
    assert db.upsert_run(campaign, "sync", "a", HASH_A, status="finished",
                         summary=summary) == run_id
    assert db.get_run(run_id) == done  # repeating the final write changes nothing

    other = db.upsert_run(campaign, "sync", "b", HASH_B, status="rejected")
    db.upsert_run(campaign, "one_step", "a", HASH_B)
    assert other != run_id
    assert [x.candidate for x in db.runs(campaign, "sync")] == ["a", "b"]
    assert len(db.runs(campaign)) == 3
    assert db.get_run(other).finished_at is not None
    assert db.get_run(999) is None
    assert db.get_run(campaign_id=campaign, stage="sync", candidate="zz") is None

    with pytest.raises(RegistryError, match="unknown run field"):
        db.upsert_run(campaign, "sync", "a", HASH_A, colour="red")
    with pytest.raises(RegistryError, match="unknown run status"):
        db.upsert_run(campaign, "sync", "a", HASH_A, status="great")
    with pytest.raises(RegistryError, match="put_recipe it first"):
        db.upsert_run(campaign, "sync", "c", "f" * 64)
    with pytest.raises(RegistryError, match="create_campaign first"):
        db.upsert_run("missing", "sync", "c", HASH_A)
    with pytest.raises(RegistryError, match="needs a run_id"):
        db.get_run(campaign_id=campaign, stage="sync")


# ---- gates ------------------------------------------------------------------------------------


GATES = [
    {"name": "mismatch_k3", "passed": True, "value": 0.004, "threshold": 0.01,
     "window": (40, 60), "evidence": "mean over the last 20 steps",
     "params": {"metric": "mismatch/k3_kl", "agg": "mean"}, "noise": 0.002},
    {"name": "reward_up", "passed": False, "value": float("nan"), "threshold": 0.05,
     "window": None, "evidence": {"first": 0.39, "last": 0.40}, "params": None},
]


def test_gate_results(db, campaign):
    run_id = db.upsert_run(campaign, "sync", "a", HASH_A, status="finished")
    assert db.gate_results(run_id) == []
    db.record_gate_results(run_id, GATES)
    got = db.gate_results(run_id)
    assert [g.name for g in got] == ["mismatch_k3", "reward_up"]
    g0, g1 = got
    assert (g0.passed, g0.value, g0.threshold, g0.window) == (
        True, 0.004, 0.01, (40, 60))
    assert g0.evidence == "mean over the last 20 steps"
    assert g0.params == {"metric": "mismatch/k3_kl", "agg": "mean"}
    assert g1.passed is False and g1.value is None and g1.window is None
    assert g1.evidence == {"first": 0.39, "last": 0.40} and g1.params is None
    json.dumps([g.to_dict() for g in got])

    db.record_gate_results(run_id, GATES)  # the same again: rows untouched
    assert db.gate_results(run_id) == got
    db.record_gate_results(run_id, [{**GATES[0], "passed": False, "value": 0.02}])
    again = db.gate_results(run_id)
    assert len(again) == 1 and again[0].passed is False and again[0].value == 0.02
    db.record_gate_results(run_id, [])
    assert db.gate_results(run_id) == []

    with pytest.raises(RegistryError, match="upsert_run first"):
        db.record_gate_results(12345, GATES)
    with pytest.raises(RegistryError, match="appears twice"):
        db.record_gate_results(run_id, [GATES[0], GATES[0]])
    with pytest.raises(RegistryError, match="'name' and 'passed'"):
        db.record_gate_results(run_id, [{"name": "x"}])


# ---- promotions -------------------------------------------------------------------------------


def test_auto_promotion_is_idempotent(db, campaign):
    assert db.promoted(campaign, "sync") is None
    pid = db.promote(recipe_hash=HASH_A, candidate="a", checkpoint="/runs/c1/sync/a/final",
                     campaign_id=campaign, stage="sync", mlflow_version="1")
    first = db.promoted(campaign, "sync")
    assert first.id == pid and first.actor == "auto" and first.status == "active"
    assert (first.candidate, first.recipe_hash, first.checkpoint,
            first.mlflow_version) == ("a", HASH_A, "/runs/c1/sync/a/final", "1")
    assert db.stages(campaign)[0].promoted_candidate == "a"

    again = db.promote(recipe_hash=HASH_A, candidate="a", checkpoint="/elsewhere",
                       campaign_id=campaign, stage="sync", mlflow_version="2")
    assert again == pid
    assert db.promotions(campaign_id=campaign) == [first]  # changed nothing
    with pytest.raises(RegistryError, match="already auto-promoted"):
        db.promote(recipe_hash=HASH_B, candidate="b", checkpoint=None,
                   campaign_id=campaign, stage="sync")
    with pytest.raises(RegistryError, match="needs campaign_id and stage"):
        db.promote(recipe_hash=HASH_A, candidate="a", checkpoint=None)
    with pytest.raises(RegistryError, match="put_recipe it first"):
        db.promote(recipe_hash="f" * 64, candidate="a", checkpoint=None,
                   campaign_id=campaign, stage="one_step")


def test_manual_promotion_and_retire(db, campaign):
    auto = db.promote(recipe_hash=HASH_A, candidate="a", checkpoint="/ck/a",
                      campaign_id=campaign, stage="sync")
    with pytest.raises(RegistryError, match="needs a reason"):
        db.promote(recipe_hash=HASH_B, candidate="b", checkpoint="/ck/b",
                   campaign_id=campaign, stage="sync", actor="alice")
    with pytest.raises(RegistryError, match="needs a reason"):
        db.promote(recipe_hash=HASH_B, candidate="b", checkpoint="/ck/b", actor="alice",
                   reason="   ")
    manual = db.promote(recipe_hash=HASH_B, candidate="b", checkpoint="/ck/b",
                        campaign_id=campaign, stage="sync", actor="alice",
                        reason="b has the better eval at equal stability")
    assert manual != auto
    assert db.promoted(campaign, "sync").id == manual  # the newest active one
    assert db.stages(campaign)[0].promoted_candidate == "b"
    global_one = db.promote(recipe_hash=HASH_A, candidate="a", checkpoint=None, actor="bob",
                            reason="baseline for the team")
    assert db.get_campaign(campaign) is not None
    assert {p.id for p in db.promotions(status="active")} == {auto, manual, global_one}
    assert {p.id for p in db.promotions(campaign_id=campaign)} == {auto, manual}

    with pytest.raises(RegistryError, match="needs a reason"):
        db.retire(manual, actor="alice", reason="")
    with pytest.raises(RegistryError, match="no promotion 999"):
        db.retire(999, actor="alice", reason="x")
    db.retire(manual, actor="alice", reason="diverged at step 300 of the next stage")
    retired = [p for p in db.promotions(status="retired")]
    assert [p.id for p in retired] == [manual]
    assert retired[0].retired_by == "alice" and retired[0].retired_at is not None
    assert retired[0].retire_reason == "diverged at step 300 of the next stage"
    assert db.promoted(campaign, "sync").id == auto
    assert db.stages(campaign)[0].promoted_candidate == "a"
    db.retire(manual, actor="carol", reason="again")  # already retired: no-op
    assert db.promotions(status="retired") == retired

    db.retire(auto, actor="alice", reason="superseded")
    assert db.promoted(campaign, "sync") is None
    assert db.stages(campaign)[0].promoted_candidate is None
    # a resumed campaign's promote task does not resurrect a retired auto promotion
    assert db.promote(recipe_hash=HASH_A, candidate="a", checkpoint="/ck/a",
                      campaign_id=campaign, stage="sync") == auto
    assert db.promoted(campaign, "sync") is None
    with pytest.raises(RegistryError, match="unknown promotion status"):
        db.promotions(status="gone")


# ---- records ----------------------------------------------------------------------------------


def _layout(record, expected: dict) -> None:
    """``record.to_dict()`` is ``expected``, keys in the same order (``--json`` prints them so)."""
    assert list(record.to_dict().items()) == list(expected.items())


def test_reads_return_frozen_records_whose_to_dict_is_the_old_layout(db, campaign):
    """Each read returns its typed, frozen record with the values written; ``to_dict()`` is the
    plain dict the reads returned before records existed (written out by hand here)."""
    summary = {"steps": 10, "reward": {"mean": 0.47}}
    diagnosis = {"causes": [{"id": "C"}]}
    db.set_campaign_status(campaign, "stopped", verdict="no candidate passed", diagnosis=diagnosis)
    run_id = db.upsert_run(campaign, "sync", "a", HASH_A, status="finished",
                           run_dir="/runs/c1/sync/a", mlflow_run_id="abc123", summary=summary)
    db.record_gate_results(run_id, GATES)
    pid = db.promote(recipe_hash=HASH_A, candidate="a", checkpoint="/runs/c1/sync/a/final",
                     campaign_id=campaign, stage="sync", mlflow_version="1")
    me = ProcessIdentity.current()
    assert db.acquire_campaign(campaign, me, 90.0) is None

    c = db.get_campaign(campaign)
    assert isinstance(c, CampaignRecord) and db.list_campaigns() == [c]
    _layout(c, {"id": "c1", "name": "ladder", "spec": SPEC, "status": "stopped",
                "verdict": "no candidate passed", "diagnosis": diagnosis,
                "created_at": c.created_at, "updated_at": c.updated_at})

    (st,) = db.stages(campaign)
    assert isinstance(st, StageRecord)
    _layout(st, {"campaign_id": "c1", "name": "sync", "index": 0, "status": "running",
                 "promoted_candidate": "a", "created_at": st.created_at,
                 "updated_at": st.updated_at})

    r = db.get_recipe(HASH_B)
    assert isinstance(r, RecipeRecord)
    _layout(r, {"hash": HASH_B, "name": "base+one_step",
                "yaml": "model: tiny\nsteps: 10\nasync: one_step\n", "created_at": r.created_at})

    run = db.get_run(run_id)
    assert isinstance(run, RunRecord)
    assert db.get_run(campaign_id=campaign, stage="sync", candidate="a") == run
    assert db.runs(campaign) == db.runs(campaign, "sync") == [run]
    assert (run.id, run.candidate, run.status, run.summary) == (run_id, "a", "finished", summary)
    _layout(run, {
        "id": run_id,
        "campaign_id": "c1",
        "stage": "sync",
        "candidate": "a",
        "recipe_hash": HASH_A,
        "status": "finished",
        "run_dir": "/runs/c1/sync/a",
        "mlflow_run_id": "abc123",
        "summary": {"steps": 10, "reward": {"mean": 0.47}},
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "created_at": run.created_at,
        "updated_at": run.updated_at,
    })

    g0, g1 = db.gate_results(run_id)
    assert isinstance(g0, GateRecord) and isinstance(g1, GateRecord)
    _layout(g0, {"run_id": run_id, "name": "mismatch_k3", "passed": True, "value": 0.004,
                 "threshold": 0.01, "window": (40, 60), "evidence": "mean over the last 20 steps",
                 "params": {"metric": "mismatch/k3_kl", "agg": "mean"}, "noise": 0.002,
                 "created_at": g0.created_at})
    _layout(g1, {"run_id": run_id, "name": "reward_up", "passed": False, "value": None,
                 "threshold": 0.05, "window": None, "evidence": {"first": 0.39, "last": 0.40},
                 "params": None, "noise": None, "created_at": g1.created_at})

    p = db.promoted(campaign, "sync")
    assert isinstance(p, PromotionRecord)
    assert db.promotions(campaign_id=campaign) == db.promotions(status="active") == [p]
    _layout(p, {
        "id": pid,
        "campaign_id": "c1",
        "stage": "sync",
        "candidate": "a",
        "recipe_hash": HASH_A,
        "checkpoint": "/runs/c1/sync/a/final",
        "mlflow_version": "1",
        "actor": "auto",
        "reason": "",
        "status": "active",
        "created_at": p.created_at,
        "retired_at": None,
        "retired_by": None,
        "retire_reason": None,
    })

    o = db.campaign_owner(campaign, 90.0)
    assert isinstance(o, OwnerRecord)
    assert o.describe.startswith(f"PID {os.getpid()} on {me.host} (since ")
    _layout(o, {"campaign_id": "c1", "host": me.host, "pid": os.getpid(),
                "start_ticks": me.start_ticks, "acquired_at": o.acquired_at,
                "heartbeat_at": o.heartbeat_at, "alive": True, "describe": o.describe})

    records = [c, st, r, run, g0, g1, p, o]
    stamps = [c.created_at, c.updated_at, st.created_at, st.updated_at, r.created_at,
              run.started_at, run.finished_at, run.created_at, run.updated_at, g0.created_at,
              g1.created_at, p.created_at, o.acquired_at, o.heartbeat_at]
    assert all(datetime.fromisoformat(ts).utcoffset().total_seconds() == 0 for ts in stamps)
    json.dumps([x.to_dict() for x in records])  # JSON-ready
    for x in records:
        with pytest.raises(FrozenInstanceError):
            setattr(x, fields(x)[0].name, None)
    copy = run.to_dict()
    copy["summary"]["steps"] = 0  # to_dict() hands out copies of the JSON values
    assert run.summary == summary and db.get_run(run_id) == run


# ---- concurrency ------------------------------------------------------------------------------


def test_two_writers_at_once_never_lock(db_url):
    """Two registry objects (as two processes would) write the same database from two threads:
    no "database is locked", every write lands, the shared rows stay unique."""
    a, b = RegistryDB(db_url), RegistryDB(db_url)
    a.put_recipe(HASH_A, "base", "x: 1\n")
    errors: list[BaseException] = []
    ids: dict[str, list[int]] = {"a": [], "b": []}

    def work(db: RegistryDB, who: str) -> None:
        try:
            for i in range(40):
                db.create_campaign("shared", "shared", SPEC)  # both create the same campaign
                db.put_recipe(HASH_B, "same", "y: 2\n")
                db.upsert_stage("shared", f"s{i % 4}", i % 4, "running")
                run_id = db.upsert_run("shared", f"s{i % 4}", f"{who}{i}", HASH_A,
                                       status="finished", summary={"i": i})
                db.record_gate_results(run_id, [{"name": "g", "passed": i % 2 == 0,
                                                 "value": float(i)}])
                db.upsert_run("shared", "s0", "both", HASH_A, status="running")
                db.promote(recipe_hash=HASH_A, candidate="c", checkpoint=None,
                           campaign_id="shared", stage="s0")
                ids[who].append(run_id)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(d, w)) for d, w in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == [], errors
        assert len(a.runs("shared")) == 81  # 2 × 40 own runs + the shared one
        assert len(set(ids["a"]) | set(ids["b"])) == 80
        assert len(b.promotions(campaign_id="shared")) == 1
        assert len(b.stages("shared")) == 4
        assert all(len(a.gate_results(i)) == 1 for i in ids["b"])
    finally:
        a.close()
        b.close()


# ---- SQLite settings --------------------------------------------------------------------------


def test_sqlite_uses_wal_busy_timeout_and_foreign_keys(tmp_path):
    db = RegistryDB(f"sqlite:///{tmp_path / 'deep' / 'dir' / 'registry.db'}")
    try:
        assert (tmp_path / "deep" / "dir" / "registry.db").exists()
        with db._engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30000
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
    finally:
        db.close()


def test_default_url_is_under_the_state_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("ASYNCRL_REGISTRY_URL", raising=False)
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))
    assert default_url() == f"sqlite:///{tmp_path / 'home' / 'registry.db'}"
    db = RegistryDB()
    try:
        assert db.url == default_url()
        assert (tmp_path / "home" / "registry.db").exists()
    finally:
        db.close()
    monkeypatch.setenv("ASYNCRL_REGISTRY_URL", "postgresql+psycopg://u@db.example/reg")
    assert default_url() == "postgresql+psycopg://u@db.example/reg"


# ---- errors -----------------------------------------------------------------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_postgres_is_one_line_without_password():
    port = _closed_port()
    with pytest.raises(RegistryError) as info:
        RegistryDB(f"postgresql+psycopg://asyncrl:s3cr3t-pw@127.0.0.1:{port}/registry")
    message = str(info.value)
    assert "\n" not in message
    assert "s3cr3t-pw" not in message
    assert message.startswith(f"cannot open the registry at postgresql+psycopg://asyncrl:***@"
                              f"127.0.0.1:{port}/registry: ")
    assert "check that the database server is running" in message


def test_unparseable_url_is_a_registry_error():
    with pytest.raises(RegistryError, match="cannot parse the registry URL"):
        RegistryDB("not a url")


def test_database_newer_than_the_code_is_a_clear_error(db, db_url):
    with db._engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(RegistryError, match="newer asyncrl") as info:
        RegistryDB(db_url)
    assert "\n" not in str(info.value)


def test_postgres_fixture_url(postgres_url):
    assert postgres_url.startswith("postgresql+psycopg://postgres@127.0.0.1:")
    assert postgres_url.endswith("/asyncrl_test")
    db = RegistryDB(postgres_url)
    try:
        assert db.schema_revision() == head_revision()
    finally:
        db.close()


def test_registry_imports_no_heavy_packages():
    """The registry is usable without torch, Prefect, MLflow or Ray loaded."""
    code = ("import sys, registry.db, registry.models; registry.db.RegistryDB; "
            "print([m for m in ('torch', 'prefect', 'mlflow', 'ray') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_bare_postgresql_url_opens_with_psycopg3(postgres_db):
    """`ASYNCRL_REGISTRY_URL=postgresql://…` as users write it: psycopg 3 (SQLAlchemy 2.0 would
    pick psycopg2, which is not installed)."""
    bare = "postgresql://" + postgres_db.removeprefix("postgresql+psycopg://")
    db = RegistryDB(bare)
    try:
        assert db.url.startswith("postgresql+psycopg://")
        assert db.schema_revision() == head_revision()
    finally:
        db.close()
