"""Promotion retirement: who retired a promotion, when and why; an index for listing by status.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

COLUMNS = ("retired_at", "retired_by", "retire_reason")


def upgrade() -> None:
    # ADD COLUMN is native on SQLite and PostgreSQL: no table rebuild.
    op.add_column("promotions", sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("promotions", sa.Column("retired_by", sa.String(200), nullable=True))
    op.add_column("promotions", sa.Column("retire_reason", sa.Text(), nullable=True))
    op.create_index("ix_promotions_status", "promotions", ["status"])


def downgrade() -> None:
    op.drop_index("ix_promotions_status", table_name="promotions")
    # DROP COLUMN is native on PostgreSQL and on SQLite >= 3.35 (none of these columns is
    # indexed or constrained), so the table — and its partial unique index — is never rebuilt.
    for column in reversed(COLUMNS):
        op.drop_column("promotions", column)
