"""The in-process campaign harness shared by the end-to-end campaign tests.

``run_campaign(tmp_path_factory, name, campaign)`` is a context manager: it gives the campaign its
own ``$ASYNCRL_HOME`` (so the registry, MLflow store and run directories are the test's own),
writes ``campaign`` (a dict) there as ``<name>.yaml`` and yields ``(home, path)``; on exit it shuts
Ray down if a run started it and restores ``ASYNCRL_HOME`` and ``MLFLOW_TRACKING_URI``. The tests
then call ``flows.campaign.campaign_flow`` inside it, as ``asyncrl campaign launch`` does.

Prefect's test harness (a temporary API server and database, 10-17 s to start on 2 cores) is one
for this directory's tests: the first campaign opens it and the rest share it (every campaign has
its own id, so their flow runs do not mix); it is closed after the last test of this directory,
so no server or Prefect setting of it outlives tests/flows. (Not a ``scope="package"`` fixture:
without an ``__init__.py`` pytest gives that the session's lifetime.)
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
    _open_harness()
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


_HARNESS = contextlib.ExitStack()
_HARNESS_OPEN = [False]
_HERE = Path(__file__).resolve().parent


def _open_harness() -> None:
    if not _HARNESS_OPEN[0]:
        from prefect.testing.utilities import prefect_test_harness

        _HARNESS.enter_context(prefect_test_harness(server_startup_timeout=120))
        _HARNESS_OPEN[0] = True


@pytest.hookimpl(trylast=True)  # after the fixtures of the finished test are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Close the harness once the next test (if any) is outside this directory."""
    if _HARNESS_OPEN[0] and (nextitem is None
                             or _HERE not in Path(nextitem.path).resolve().parents):
        _HARNESS.close()
        _HARNESS_OPEN[0] = False


@pytest.fixture(scope="session")
def run_campaign():
    """The context manager above (a session fixture, so module-scoped campaign fixtures can use
    it); it opens the directory's Prefect harness on first use."""
    return _run_campaign
