"""Drop transactions_open_due_idx: account statements planned a full scan of it

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 16:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Same predicate as transactions_open_account_order_idx (open items), so every statement
    # that can use one can use the other. On statistics older than the table's growth the
    # planner chose it for one account's rows: a scan of every open item of every account
    # with a filter (the drain's claim and last statement, 10 to 20 ms each at 10,000 open
    # items), and, as the inner side of the sweeper's anti join, once per open batch (a 19 s
    # pass). The sweeper's own scan of due items reads every open item either way.
    op.drop_index(
        "transactions_open_due_idx",
        table_name="transactions",
        postgresql_where=sa.text("status NOT IN ('succeeded', 'failed', 'dead')"),
    )


def downgrade() -> None:
    op.create_index(
        "transactions_open_due_idx",
        "transactions",
        ["status", "next_attempt_at"],
        unique=False,
        postgresql_where=sa.text("status NOT IN ('succeeded', 'failed', 'dead')"),
    )
