"""One launch of a campaign: loaded once, recorded once, leased once.

Whoever starts a campaign loads it (:func:`registry.campaign.load_campaign`): the CLI, to
validate the file and name the id before anything starts; the deployment's flow, from the file
its parameters name. :func:`launch_campaign` then records it in the registry and takes its lease
(:class:`registry.ownership.CampaignLease`) for as long as its stages run.

The CLI launches before it starts Prefect, so that a second launch of a running campaign is
refused in one line naming the owner, not as a failed flow run, and then runs the flow in the
same process. A flow's parameters must be plain data (the Prefect UI shows them), so the flow
finds that launch here by campaign id (:func:`launched`) instead of loading, recording and
leasing the campaign again; called on its own (the tests, a re-run from the Prefect UI), it
launches the campaign itself, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.campaign import Campaign, load_campaign

if TYPE_CHECKING:
    from registry.db import RegistryDB
    from registry.ownership import CampaignLease
    from training.recipe import Recipe

__all__ = ["Launch", "launch_campaign", "launched", "record_campaign"]


@dataclass(frozen=True)
class Launch:
    """A campaign this process has recorded and owns: the validated campaign and its base recipe
    (as :func:`load_campaign` returns them), its file, its id, the registry (``registry_url``;
    None: the default) and the lease held on it."""

    campaign: Campaign
    base: Recipe
    path: Path
    campaign_id: str
    registry_url: str | None
    db: RegistryDB
    lease: CampaignLease


# The launches open in this process, by (registry URL as given, campaign id): how the flow run
# the CLI starts finds the CLI's launch.
_OPEN: dict[tuple[str | None, str], Launch] = {}


@contextlib.contextmanager
def launch_campaign(campaign: Campaign, base: Recipe, campaign_path: str | Path,
                    campaign_id: str, *, registry_url: str | None = None
                    ) -> Iterator[Launch]:
    """Record the loaded ``campaign`` under ``campaign_id`` and hold its lease inside the
    ``with`` block. Raises :class:`registry.db.CampaignOwnedError` (a ``RegistryError``) when
    another live process runs the campaign, and ``RegistryError`` when the id names a different
    campaign file — both before anything is written but the record."""
    from registry.db import RegistryDB
    from registry.ownership import CampaignLease

    path = Path(campaign_path)
    with RegistryDB(registry_url) as db:
        record_campaign(db, campaign, base, path, campaign_id)
        with CampaignLease(db, campaign_id) as lease:
            key = (registry_url, campaign_id)
            if key in _OPEN:  # a programming error: the lease above would have refused it
                raise RuntimeError(f"campaign {campaign_id} is launched twice in one process")
            _OPEN[key] = Launch(campaign, base, path, campaign_id, registry_url, db, lease)
            try:
                yield _OPEN[key]
            finally:
                del _OPEN[key]


@contextlib.contextmanager
def launched(campaign_path: str | Path, campaign_id: str, *, registry_url: str | None = None,
             loaded: tuple[Campaign, Recipe] | None = None) -> Iterator[Launch]:
    """The launch of ``campaign_id`` open in this process (the CLI's), else a new one of the
    campaign in ``campaign_path`` — ``loaded`` when the caller has loaded it already — for the
    ``with`` block."""
    held = _OPEN.get((registry_url, campaign_id))
    if held is not None:
        if held.path.resolve() != Path(campaign_path).resolve():
            raise RuntimeError(f"campaign {campaign_id} was launched from {held.path}, "
                               f"not {campaign_path}")
        yield held
        return
    campaign, base = loaded if loaded is not None else load_campaign(campaign_path)
    with launch_campaign(campaign, base, campaign_path, campaign_id,
                         registry_url=registry_url) as new:
        yield new


def record_campaign(db: Any, campaign: Campaign, base: Recipe, campaign_path: Path,
                    campaign_id: str) -> None:
    """Record the campaign under ``campaign_id`` in the registry (idempotent; a different
    campaign file under an existing id is a ``RegistryError``)."""
    # identity of a campaign id: the file's content and the base recipe's hash (not its full
    # data: defaults a newer asyncrl adds, or an unused backend's settings, must not make a
    # resume after an upgrade look like a different campaign)
    db.create_campaign(campaign_id, campaign.name, {
        "campaign": campaign.model_dump(mode="json", exclude_defaults=True),
        "base_recipe_hash": base.hash(),
        "path": str(Path(campaign_path).resolve())})
