"""Gate results record their noise: the standard error of the value that the gate's noise
floor is built from, so a margin can be read in noise units (the dashboard's ladder).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("gate_results") as batch:
        batch.add_column(sa.Column("noise", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("gate_results") as batch:
        batch.drop_column("noise")
