"""Remediations: each attempt a stage made to repair itself after every candidate failed
(``remediate:`` on a stage; ``registry.remediation``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "remediations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("campaign_id", sa.String(200), nullable=False),
        sa.Column("stage", sa.String(200), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("from_candidate", sa.String(200), nullable=False),
        sa.Column("candidate", sa.String(200), nullable=True),
        sa.Column("cause", sa.String(64), nullable=True),
        sa.Column("title", sa.Text(), nullable=True),
        sa.Column("source", sa.Text(), nullable=True),
        sa.Column("evidence", sa.Text(), nullable=True),
        sa.Column("override", sa.Text(), nullable=True),
        sa.Column("diagnosis", sa.Text(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["campaign_id"], ["campaigns.id"], ondelete="CASCADE",
                                name="fk_remediations_campaign_id_campaigns"),
        sa.PrimaryKeyConstraint("id", name="pk_remediations"),
        sa.UniqueConstraint("campaign_id", "stage", "attempt",
                            name="uq_remediations_campaign_id_stage_attempt"),
    )


def downgrade() -> None:
    op.drop_table("remediations")
