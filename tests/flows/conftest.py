"""The in-process campaign harness shared by the end-to-end campaign tests.

``run_campaign(tmp_path_factory, name, campaign)`` is a context manager: it gives the campaign its
own ``$ASYNCRL_HOME`` (so the registry, MLflow store and run directories are the test's own),
writes ``campaign`` (a dict) there as ``<name>.yaml`` and yields ``(home, path)``; on exit it shuts
Ray down if a run started it and restores ``ASYNCRL_HOME`` and ``MLFLOW_TRACKING_URI``. The tests
then call ``flows.campaign.campaign_flow`` inside it, as ``asyncrl campaign launch`` does.

Prefect's test harness (a temporary API server and database, 10-17 s to start on 2 cores) is one
for the package (``prefect_harness``), started by the first campaign fixture and shared by the
rest: every campaign has its own id, so their flow runs do not mix.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

_SAVED = ("ASYNCRL_HOME", "MLFLOW_TRACKING_URI")


@contextlib.contextmanager
def _run_campaign(tmp_path_factory: pytest.TempPathFactory, name: str,
                  campaign: Mapping[str, Any]) -> Iterator[tuple[Path, Path]]:
    home = tmp_path_factory.mktemp("home")
    saved = {k: os.environ.get(k) for k in _SAVED}
    os.environ["ASYNCRL_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    path = home / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(campaign)))
    import ray

    try:
        yield home, path
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="package")
def prefect_harness() -> Iterator[None]:
    """One Prefect test harness for the package's campaign fixtures, stopped after its last test."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="package")
def run_campaign(prefect_harness):
    """The context manager above (package scope, so module-scoped campaign fixtures can use it),
    inside the package's Prefect harness."""
    return _run_campaign
