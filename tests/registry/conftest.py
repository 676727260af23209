"""Registry test fixtures: a fresh database URL per test on each backend (``sqlite`` and
``postgresql``). The PostgreSQL server of the session (``postgres_server``, and
``ASYNCRL_TEST_POSTGRES_URL`` to use a running one) is started by tests/conftest.py, which
tests/flows shares.
"""

from __future__ import annotations

import pytest

PG_DATABASE = "asyncrl_test"


@pytest.fixture(scope="session")
def postgres_url(postgres_server, postgres_admin) -> str:
    """``postgresql+psycopg://postgres@127.0.0.1:PORT/asyncrl_test``: a database on the session's
    server."""
    postgres_admin(f'DROP DATABASE IF EXISTS "{PG_DATABASE}" WITH (FORCE)')
    postgres_admin(f'CREATE DATABASE "{PG_DATABASE}"')
    return f"{postgres_server}/{PG_DATABASE}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """A URL of a fresh, empty registry database on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'registry.db'}"
    return request.getfixturevalue("postgres_db")


@pytest.fixture
def backend(db_url) -> str:
    return "sqlite" if db_url.startswith("sqlite") else "postgresql"
