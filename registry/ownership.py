"""One owner per campaign: the lease a campaign flow holds while it runs.

Two ``asyncrl campaign resume ID`` at once once both ran and interleaved their writes (duplicated
MLflow points, a ``metrics.jsonl`` cut to 2 of 7 rows). Now the flow takes the campaign's lease
before it touches anything (:meth:`RegistryDB.acquire_campaign`, atomic on SQLite and
PostgreSQL), a second process is refused with one line naming the owner, and the lease dies with
its holder: on this host a dead PID (or a PID reused by another process: the start time differs)
frees it at once; from another host, a heartbeat older than :data:`HEARTBEAT_TTL_S` does. The
owner refreshes the heartbeat every :data:`HEARTBEAT_EVERY_S` seconds from a daemon thread,
and a beat that finds the campaign taken over stops the process at once (``_lost``).

A campaign whose registry status is ``running`` but whose owner is gone has crashed:
:func:`effective_status` says so (``campaign status`` / ``list`` show it with the resume
command).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from registry.records import CampaignRecord, OwnerRecord
from training.ownership import ProcessIdentity

if TYPE_CHECKING:  # effective_status also takes the SQLAlchemy-free registry.sqlite_reader
    from registry.db import RegistryDB
    from registry.sqlite_reader import SQLiteReader

__all__ = ["HEARTBEAT_EVERY_S", "HEARTBEAT_TTL_S", "CampaignLease", "effective_status"]

log = logging.getLogger("asyncrl.registry")

HEARTBEAT_EVERY_S = 10.0
#: An owner on another host whose heartbeat is older than this is taken for dead.
HEARTBEAT_TTL_S = 90.0


class CampaignLease:
    """Hold the campaign's ownership for the duration of a ``with`` block.

    ``previous`` is the crashed owner's record when this lease took over from one (None for a
    fresh start or a clean resume). Raises :class:`registry.db.CampaignOwnedError` on entry
    when a live process owns the campaign — this one too, under another lease: a launch takes
    the lease once (:mod:`flows.launch`) and its flow runs under it."""

    def __init__(self, db: RegistryDB, campaign_id: str) -> None:
        self.db = db
        self.campaign_id = campaign_id
        self.identity = ProcessIdentity.current()
        self.previous: OwnerRecord | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CampaignLease:
        self.previous = self.db.acquire_campaign(self.campaign_id, self.identity,
                                                 HEARTBEAT_TTL_S)
        self._thread = threading.Thread(target=self._beat, name="asyncrl-campaign-heartbeat",
                                        daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY_S):
            try:
                owned = self.db.heartbeat_campaign(self.campaign_id, self.identity.token)
            except Exception as e:  # a registry hiccup: the next beat tries again
                log.warning("campaign %s heartbeat failed: %s", self.campaign_id, e)
                continue
            if not owned and not self._stop.is_set():
                self._lost()
                return

    def _lost(self) -> None:
        """Another process took the campaign over (this one's heartbeat was older than the TTL,
        e.g. a suspended machine on a shared registry). Two owners would duplicate its writes,
        so this process stops at once, as a ``kill -9`` would — no status or MLflow write that
        could overwrite the new owner's — and its runs resume under the new owner."""
        import os
        import signal

        log.error("lost the ownership of campaign %s to another process; stopping this one",
                  self.campaign_id)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.db.release_campaign(self.campaign_id, self.identity.token)
        except Exception as e:  # the row stays; its dead PID frees it for the next owner
            log.warning("could not release campaign %s: %s", self.campaign_id, e)


def effective_status(db: RegistryDB | SQLiteReader, campaign: CampaignRecord
                     ) -> tuple[str, OwnerRecord | None]:
    """``(status, owner)``: the recorded status, except ``"crashed"`` for a ``running``
    campaign whose owner is gone (or was never recorded); ``owner`` is its record or None."""
    owner = db.campaign_owner(campaign.id, HEARTBEAT_TTL_S)
    if campaign.status == "running" and (owner is None or not owner.alive):
        return "crashed", owner
    return campaign.status, owner
