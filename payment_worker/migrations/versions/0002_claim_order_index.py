"""Index for claiming an account's open items in batch order (replaces account+status)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 10:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # the claim walks one account's open items in (batch_pk, id) order and stops at its LIMIT,
    # instead of sorting every open item of the account for each chunk
    op.create_index(
        "transactions_open_account_order_idx",
        "transactions",
        ["account_id", "batch_pk", "id"],
        unique=False,
        postgresql_where=sa.text("status NOT IN ('succeeded', 'failed', 'dead')"),
    )
    # every status change updates every index of the row (no HOT update): an index that the
    # new one makes redundant is pure write cost
    op.drop_index("transactions_open_account_idx", table_name="transactions")


def downgrade() -> None:
    op.create_index(
        "transactions_open_account_idx",
        "transactions",
        ["account_id", "status"],
        unique=False,
        postgresql_where=sa.text("status NOT IN ('succeeded', 'failed', 'dead')"),
    )
    op.drop_index("transactions_open_account_order_idx", table_name="transactions")
