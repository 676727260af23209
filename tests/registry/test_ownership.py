"""One owner per campaign (registry.ownership) on SQLite and PostgreSQL: a live owner refuses a
second one with its PID named, a dead one (killed process, reused PID, stale heartbeat of another
host) is taken over, and processes racing for a fresh campaign get exactly one winner."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from registry.db import CampaignOwnedError, RegistryDB
from registry.models import CampaignOwnerRow, utcnow
from registry.ownership import HEARTBEAT_TTL_S, CampaignLease, effective_status
from training.ownership import ProcessIdentity

SPEC = {"name": "c", "stages": []}


def _db(url: str) -> RegistryDB:
    db = RegistryDB(url)
    db.create_campaign("c1", "c", SPEC)
    return db


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_live_owner_refuses_a_second_and_release_frees_it(db_url):
    db = _db(db_url)
    me = ProcessIdentity.current()
    assert db.acquire_campaign("c1", me, HEARTBEAT_TTL_S) is None
    assert db.acquire_campaign("c1", me, HEARTBEAT_TTL_S) is None  # the same owner: a refresh
    other = replace(ProcessIdentity.current(), token="other")  # same live process, 2nd owner
    with pytest.raises(CampaignOwnedError) as err:
        db.acquire_campaign("c1", other, HEARTBEAT_TTL_S)
    msg = str(err.value)
    assert f"PID {os.getpid()}" in msg and "\n" not in msg and "asyncrl campaign status" in msg
    assert err.value.owner.pid == os.getpid() and err.value.owner.alive is True
    db.release_campaign("c1", me.token)
    assert db.campaign_owner("c1", HEARTBEAT_TTL_S) is None
    assert db.acquire_campaign("c1", other, HEARTBEAT_TTL_S) is None
    db.close()


def test_dead_or_reused_pid_and_stale_remote_heartbeat_are_taken_over(db_url):
    db = _db(db_url)
    dead = replace(ProcessIdentity.current(), pid=_dead_pid(), token="dead")
    db.acquire_campaign("c1", dead, HEARTBEAT_TTL_S)
    assert db.campaign_owner("c1", HEARTBEAT_TTL_S).alive is False
    me = ProcessIdentity.current()
    previous = db.acquire_campaign("c1", me, HEARTBEAT_TTL_S)
    assert previous is not None and previous.pid == dead.pid
    db.release_campaign("c1", me.token)

    # this process's PID with another start time: the PID was reused, the owner is gone
    reused = replace(me, start_ticks=(me.start_ticks or 0) + 12345, token="reused")
    db.acquire_campaign("c1", reused, HEARTBEAT_TTL_S)
    assert db.campaign_owner("c1", HEARTBEAT_TTL_S).alive is False
    assert db.acquire_campaign("c1", me, HEARTBEAT_TTL_S).pid == os.getpid()
    db.release_campaign("c1", me.token)

    # another host: alive while its heartbeat is fresh, dead once it is older than the TTL
    remote = replace(me, host="elsewhere.invalid", pid=1, token="remote")
    db.acquire_campaign("c1", remote, HEARTBEAT_TTL_S)
    with pytest.raises(CampaignOwnedError, match=r"PID 1 on elsewhere\.invalid"):
        db.acquire_campaign("c1", me, HEARTBEAT_TTL_S)
    with db._write() as s:
        s.execute(update(CampaignOwnerRow).values(
            heartbeat_at=utcnow() - timedelta(seconds=HEARTBEAT_TTL_S + 1)))
    assert db.acquire_campaign("c1", me, HEARTBEAT_TTL_S).host == "elsewhere.invalid"
    db.close()


def test_lease_status_crashed_after_kill(db_url, tmp_path):
    """A campaign whose owner was SIGKILLed shows as crashed; the next lease takes it over."""
    db = _db(db_url)
    db.set_campaign_status("c1", "running")
    code = ("import sys, time; from registry.db import RegistryDB; "
            "from registry.ownership import CampaignLease; "
            f"db = RegistryDB({db_url!r}); lease = CampaignLease(db, 'c1').__enter__(); "
            "print('owned', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "owned"
        assert effective_status(db, db.get_campaign("c1"))[0] == "running"
        with pytest.raises(CampaignOwnedError, match=f"PID {proc.pid} "), \
                CampaignLease(db, "c1"):
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    status, owner = effective_status(db, db.get_campaign("c1"))
    assert status == "crashed" and owner.pid == proc.pid and owner.alive is False
    with CampaignLease(db, "c1") as lease:
        assert lease.previous.pid == proc.pid
        assert effective_status(db, db.get_campaign("c1"))[0] == "running"
    assert db.campaign_owner("c1", HEARTBEAT_TTL_S) is None  # released on exit
    db.close()


def _race(url: str, barrier, results) -> None:
    db = RegistryDB(url)
    me = ProcessIdentity.current()
    barrier.wait()
    try:
        db.acquire_campaign("c1", me, HEARTBEAT_TTL_S)
        results.put(("won", os.getpid()))
        time.sleep(5.0)  # hold it while the others try
    except CampaignOwnedError:
        results.put(("refused", os.getpid()))
    finally:
        db.close()


@pytest.mark.slow
def test_racing_processes_get_exactly_one_owner(db_url, monkeypatch):
    _db(db_url).close()
    # spawned children unpickle _race from this module: they get the parent's sys.path, which
    # holds the repository root only under `python -m pytest` (not a bare `pytest`)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(db_url, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert sorted(o for o, _ in outcomes) == ["refused", "refused", "refused", "won"]


def test_an_owner_that_lost_the_campaign_stops_at_once(db_url):
    """A heartbeat that finds another owner (it was taken over after a stale heartbeat) kills its
    own process, as a crash would: no second writer."""
    db = _db(db_url)
    code = ("import time; import registry.ownership as o; from registry.db import RegistryDB; "
            f"o.HEARTBEAT_EVERY_S = 0.2; db = RegistryDB({db_url!r}); "
            "lease = o.CampaignLease(db, 'c1').__enter__(); print('owned', flush=True); "
            "time.sleep(60); print('still running', flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "owned"
        with db._write() as s:  # another host takes it over
            s.execute(update(CampaignOwnerRow).values(token="new-owner", host="elsewhere.invalid"))
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, (out, err)
    assert "still running" not in out and "lost the ownership of campaign c1" in err
    assert db.campaign_owner("c1", HEARTBEAT_TTL_S).host == "elsewhere.invalid"
    db.close()
