"""Since when an open transaction's steps have ended without a request reaching the gateway

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 07:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A step whose request never leaves (the token refused, Redis out of reach, the account
    # paced or cooling down) uses up no attempt, so such an item is retried without end and
    # never reaches the dead letters. This column dates the first of those steps since its
    # last request left; NULL once one leaves and on every terminal row. Nullable with no
    # default: added without rewriting the table
    op.add_column("transactions", sa.Column("unsent_since", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("transactions", "unsent_since")
