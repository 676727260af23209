"""Alembic environment of the registry.

``registry.db`` builds the Alembic config in code and hands over an open connection in
``config.attributes["connection"]`` (so SQLite gets the same pragmas and locking as the API).
Without one, an engine is made from the ``sqlalchemy.url`` option (the ``alembic`` command line
with a hand-written config). Offline mode (``--sql``) prints the DDL.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

from registry.models import Base

# Any fixed 64-bit number: the PostgreSQL advisory lock that serialises concurrent upgrades.
PG_MIGRATION_LOCK = 7_311_420_260_001

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Two processes upgrading one fresh database would both create the tables; the lock
            # (held until this transaction ends) makes the second wait and then find head.
            connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATION_LOCK})
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
