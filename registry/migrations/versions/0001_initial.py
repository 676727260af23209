"""Initial schema: campaigns, stages, recipes, candidate runs, gate results, promotions.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200
HASH = 128


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "campaigns",
        sa.Column("id", sa.String(NAME), nullable=False),
        sa.Column("name", sa.String(NAME), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("verdict", sa.Text(), nullable=True),
        sa.Column("diagnosis", sa.Text(), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_campaigns"),
    )
    op.create_table(
        "stages",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("campaign_id", sa.String(NAME), nullable=False),
        sa.Column("name", sa.String(NAME), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("promoted_candidate", sa.String(NAME), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_stages"),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"],
            name="fk_stages_campaign_id_campaigns", ondelete="CASCADE",
        ),
        sa.UniqueConstraint("campaign_id", "name", name="uq_stages_campaign_id_name"),
    )
    op.create_table(
        "recipes",
        sa.Column("hash", sa.String(HASH), nullable=False),
        sa.Column("name", sa.String(NAME), nullable=False),
        sa.Column("yaml", sa.Text(), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("hash", name="pk_recipes"),
    )
    op.create_table(
        "candidate_runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("campaign_id", sa.String(NAME), nullable=False),
        sa.Column("stage", sa.String(NAME), nullable=False),
        sa.Column("candidate", sa.String(NAME), nullable=False),
        sa.Column("recipe_hash", sa.String(HASH), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("run_dir", sa.Text(), nullable=True),
        sa.Column("mlflow_run_id", sa.String(NAME), nullable=True),
        sa.Column("summary", sa.Text(), nullable=True),
        _ts("started_at", nullable=True),
        _ts("finished_at", nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_candidate_runs"),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"],
            name="fk_candidate_runs_campaign_id_campaigns", ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["recipe_hash"], ["recipes.hash"], name="fk_candidate_runs_recipe_hash_recipes"
        ),
        sa.UniqueConstraint(
            "campaign_id", "stage", "candidate",
            name="uq_candidate_runs_campaign_id_stage_candidate",
        ),
    )
    op.create_table(
        "gate_results",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(NAME), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("threshold", sa.Float(), nullable=True),
        sa.Column("window_start", sa.Integer(), nullable=True),
        sa.Column("window_end", sa.Integer(), nullable=True),
        sa.Column("evidence", sa.Text(), nullable=True),
        sa.Column("params", sa.Text(), nullable=True),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_gate_results"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["candidate_runs.id"],
            name="fk_gate_results_run_id_candidate_runs", ondelete="CASCADE",
        ),
        sa.UniqueConstraint("run_id", "name", name="uq_gate_results_run_id_name"),
    )
    op.create_table(
        "promotions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("campaign_id", sa.String(NAME), nullable=True),
        sa.Column("stage", sa.String(NAME), nullable=True),
        sa.Column("candidate", sa.String(NAME), nullable=False),
        sa.Column("recipe_hash", sa.String(HASH), nullable=False),
        sa.Column("checkpoint", sa.Text(), nullable=True),
        sa.Column("mlflow_version", sa.String(NAME), nullable=True),
        sa.Column("actor", sa.String(NAME), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_promotions"),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"], name="fk_promotions_campaign_id_campaigns"
        ),
        sa.ForeignKeyConstraint(
            ["recipe_hash"], ["recipes.hash"], name="fk_promotions_recipe_hash_recipes"
        ),
    )
    # An auto promotion happens once per (campaign, stage): this partial unique index is what makes
    # the promote task idempotent. Manual promotions (actor = a user) are not limited.
    op.create_index(
        "uq_promotions_auto_stage",
        "promotions",
        ["campaign_id", "stage"],
        unique=True,
        sqlite_where=sa.text("actor = 'auto'"),
        postgresql_where=sa.text("actor = 'auto'"),
    )


def downgrade() -> None:
    op.drop_index("uq_promotions_auto_stage", table_name="promotions")
    for table in ("promotions", "gate_results", "candidate_runs", "recipes", "stages", "campaigns"):
        op.drop_table(table)
