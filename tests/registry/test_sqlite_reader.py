"""registry.sqlite_reader: the CLI's SQLAlchemy-free reader gives exactly RegistryDB's records
on the same SQLite registry, opens nothing it does not know, and writes nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from registry.db import SCHEMA_HEAD, RegistryDB
from registry.sqlite_reader import SQLiteReader, open_reader
from training.ownership import ProcessIdentity

HASH_A, HASH_B = "a" * 64, "b" * 64
GATES = [
    {"name": "reward_not_collapsed", "passed": True, "value": 0.41, "threshold": 0.05,
     "window": [0, 9], "evidence": "reward 0.41 ≥ 0.05", "params": {"floor": 0.05}},
    {"name": "logprob_diff_flat", "passed": False, "value": float("nan"), "threshold": None,
     "window": None, "evidence": {"slope": 0.02, "points": [1, 2]}, "params": None},
]


@pytest.fixture
def registry(tmp_path):
    """A SQLite registry with two campaigns, stages, runs, gates, promotions and an owner."""
    path = tmp_path / "registry.db"
    db = RegistryDB(f"sqlite:///{path}")
    db.put_recipe(HASH_A, "base", "steps: 10\n")
    db.put_recipe(HASH_B, "base+one", "steps: 10\nasync: one_step\n")
    for cid in ("c1", "c2"):
        db.create_campaign(cid, f"ladder-{cid}", {"name": cid, "stages": [{"name": "s"}]})
    db.set_campaign_status("c1", "stopped", verdict="no candidate passed",
                           diagnosis={"causes": [{"id": "C", "evidence": "ρ tail 3.2"}]})
    db.upsert_stage("c1", "sync", 0, "finished")
    db.upsert_stage("c1", "one", 1, "running")
    a = db.upsert_run("c1", "sync", "a", HASH_A, status="finished", run_dir="/r/a",
                      mlflow_run_id="m1", summary={"steps": 10, "reward": {"mean": 0.47}})
    b = db.upsert_run("c1", "one", "b", HASH_B, status="running")
    db.record_gate_results(a, GATES)
    db.promote(recipe_hash=HASH_A, candidate="a", checkpoint="/r/a/final", campaign_id="c1",
               stage="sync", mlflow_version="1")
    retired = db.promote(recipe_hash=HASH_B, candidate="manual", checkpoint=None,
                         reason="by hand", actor="ana")
    db.retire(retired, actor="bo", reason="worse")
    db.acquire_campaign("c1", ProcessIdentity.current(), 90.0)
    remedy = {"cause": "F", "title": "length surge", "source": "tree", "evidence": ["x > 1.2"],
              "override": {"optim.lr": 5e-5}}
    db.record_remediation("c1", "one", 1, from_candidate="b", status="failed",
                          candidate="remedy-1", remedy=remedy, diagnosis={"causes": ["F"]})
    db.record_remediation("c1", "one", 2, from_candidate="remedy-1", status="none")
    yield path, db, (a, b)
    db.close()


def test_same_records_as_registrydb(registry):
    path, db, run_ids = registry
    with SQLiteReader(path) as reader:
        assert reader.list_campaigns() == db.list_campaigns()
        for cid in ("c1", "c2", "nope"):
            assert reader.get_campaign(cid) == db.get_campaign(cid)
            assert reader.stages(cid) == db.stages(cid)
            assert reader.runs(cid) == db.runs(cid)
            assert reader.campaign_owner(cid, 90.0) == db.campaign_owner(cid, 90.0)
            assert reader.promotions(campaign_id=cid) == db.promotions(campaign_id=cid)
        assert reader.runs("c1", "one") == db.runs("c1", "one")
        for cid, stage in (("c1", None), ("c1", "one"), ("c1", "sync"), ("c2", None)):
            assert reader.remediations(cid, stage) == db.remediations(cid, stage)
        first, last = reader.remediations("c1")
        assert (first.attempt, first.candidate, first.override) == (1, "remedy-1",
                                                                    {"optim.lr": 5e-5})
        assert first.evidence == ["x > 1.2"] and first.diagnosis == {"causes": ["F"]}
        assert (last.attempt, last.status, last.candidate, last.cause) == (2, "none", None, None)
        for rid in (*run_ids, 999):
            assert reader.gate_results(rid) == db.gate_results(rid)
        for status in (None, "active", "retired"):
            assert reader.promotions(status=status) == db.promotions(status=status)
        for h in (HASH_A, HASH_B, "c" * 64):
            assert reader.get_recipe(h) == db.get_recipe(h)
        # the values themselves, not only agreement: JSON decoded, NaN as None, the owner alive
        (gate_ok, gate_bad) = reader.gate_results(run_ids[0])
        assert gate_ok.window == (0, 9) and gate_ok.params == {"floor": 0.05}
        assert gate_bad.value is None and gate_bad.evidence == {"slope": 0.02, "points": [1, 2]}
        owner = reader.campaign_owner("c1", 90.0)
        assert owner.alive and owner.pid == ProcessIdentity.current().pid
        assert reader.get_campaign("c1").created_at.endswith("+00:00")
        assert [p.status for p in reader.promotions()] == ["active", "retired"]


def test_open_reader_picks_the_reader_only_for_a_plain_sqlite_file_at_head(tmp_path, registry):
    path, _, _ = registry
    reader = open_reader(f"sqlite:///{path}")
    assert isinstance(reader, SQLiteReader)
    reader.close()
    assert open_reader(f"sqlite:///{tmp_path / 'missing.db'}") is None
    assert not (tmp_path / "missing.db").exists()
    # an older schema: RegistryDB opens it (and migrates it, as every open does)
    old = tmp_path / "old.db"
    older = RegistryDB(f"sqlite:///{old}")
    older.downgrade("0002")
    older.close()
    other = open_reader(f"sqlite:///{old}")
    assert isinstance(other, RegistryDB)
    assert other.schema_revision() == SCHEMA_HEAD
    other.close()


def test_reading_writes_nothing(registry):
    path, db, _ = registry
    db.close()
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with SQLiteReader(path) as reader:
        assert [c.id for c in reader.list_campaigns()] == ["c1", "c2"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    wal = Path(f"{path}-wal")  # SQLite's WAL index files may appear; no page is written
    assert not wal.exists() or wal.stat().st_size == 0


def test_open_reader_opens_a_server_registry_with_registrydb(postgres_db):
    db = open_reader(postgres_db)
    try:
        assert isinstance(db, RegistryDB) and db.list_campaigns() == []
    finally:
        db.close()
