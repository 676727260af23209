"""Alembic migrations of the registry schema (``registry.db`` runs them; no alembic.ini needed)."""
