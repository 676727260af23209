"""A campaign flow for deployments: ``asyncrl deploy CAMPAIGN.yaml`` serves
:func:`scheduled_campaign_flow` on a Prefect server (``flow.serve``), so the Prefect UI can run it
on a cron schedule or on demand.

A deployment's parameters are fixed when it is created, but every scheduled run must be a new
campaign (a campaign id names one run of a campaign file and its state). So this wrapper takes
only the campaign file and makes a fresh id, ``<campaign name>-<time>-<random>``, per flow run;
passing ``campaign_id`` instead continues that campaign (``asyncrl campaign resume`` does the
same from the command line).

Trigger a served deployment from a shell with
``prefect deployment run 'asyncrl-scheduled-campaign/NAME'`` (PREFECT_API_URL set to the server),
optionally ``--param campaign_id=ID`` to resume one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import flow

__all__ = ["FLOW_NAME", "scheduled_campaign_flow"]

FLOW_NAME = "asyncrl-scheduled-campaign"

log = logging.getLogger("asyncrl.campaign")


def _run_name() -> str:
    """The flow run's name at its start: the campaign id it continues, else the campaign file's
    stem until :func:`_rename` names it after the new id."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    return params.get("campaign_id") or f"{Path(str(params.get('campaign_path'))).stem} (new)"


def _rename(campaign_id: str) -> None:
    """Name the running flow run after the campaign id made for it (a display name only)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=campaign_id)
    except Exception as e:  # a name is for people; the campaign runs without it
        log.warning("the flow run was not renamed to %s (%s)", campaign_id, e)


@flow(name=FLOW_NAME, flow_run_name=_run_name, log_prints=False)
def scheduled_campaign_flow(campaign_path: str, campaign_id: str | None = None) -> Any:
    """Run the campaign in ``campaign_path`` as a new campaign (or continue ``campaign_id``);
    ends Failed, with the verdict as its message, when a stage has no passing candidate. The
    file is loaded once, here: its name makes the id, and the run launches what was loaded."""
    from flows import campaign as cflow
    from registry.campaign import load_campaign

    campaign, base = load_campaign(campaign_path)
    if campaign_id is None:
        campaign_id = cflow.new_campaign_id(campaign.name)
        _rename(campaign_id)
    return cflow.flow_result(cflow.run_campaign(Path(campaign_path), campaign_id,
                                                loaded=(campaign, base)))
