"""Campaign owners: the one process that may run a campaign now (``registry.ownership``).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "campaign_owners",
        sa.Column("campaign_id", sa.String(200), nullable=False),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("start_ticks", sa.BigInteger(), nullable=True),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["campaign_id"], ["campaigns.id"], ondelete="CASCADE",
                                name="fk_campaign_owners_campaign_id_campaigns"),
        sa.PrimaryKeyConstraint("campaign_id", name="pk_campaign_owners"),
    )


def downgrade() -> None:
    op.drop_table("campaign_owners")
