"""Fixtures shared by the runtime tests: a fresh ``ASYNCRL_HOME`` per test module (its warm starts
are built there and cached for the module), and one local Ray per module (FACTS.md: start Ray
once, not per test)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def module_home(tmp_path_factory) -> Iterator[Path]:
    """``ASYNCRL_HOME`` set to a new directory for the module, restored afterwards."""
    home = tmp_path_factory.mktemp("home")
    old = os.environ.get("ASYNCRL_HOME")
    os.environ["ASYNCRL_HOME"] = str(home)
    try:
        yield home
    finally:
        if old is None:
            os.environ.pop("ASYNCRL_HOME", None)
        else:
            os.environ["ASYNCRL_HOME"] = old


@pytest.fixture(scope="module")
def ray_session(module_home, ray_session):
    """The suite's one-Ray-per-module fixture (tests/conftest.py), started after ``module_home``
    (fixtures of one scope set up in argument order): the runtime's actors and warm starts then
    see the module's own ``ASYNCRL_HOME``."""
    return ray_session
