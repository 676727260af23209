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

from pathlib import Path
from typing import Any

from prefect import flow

__all__ = ["FLOW_NAME", "scheduled_campaign_flow"]

FLOW_NAME = "asyncrl-scheduled-campaign"


@flow(name=FLOW_NAME, log_prints=False)
def scheduled_campaign_flow(campaign_path: str, campaign_id: str | None = None) -> Any:
    """Run the campaign in ``campaign_path`` as a new campaign (or continue ``campaign_id``);
    ends Failed, with the verdict as its message, when a stage has no passing candidate. The
    file is loaded once, here: its name makes the id, and the run launches what was loaded."""
    from flows import campaign as cflow
    from registry.campaign import load_campaign

    campaign, base = load_campaign(campaign_path)
    if campaign_id is None:
        campaign_id = cflow.new_campaign_id(campaign.name)
    return cflow.flow_result(cflow.run_campaign(Path(campaign_path), campaign_id,
                                                loaded=(campaign, base)))
