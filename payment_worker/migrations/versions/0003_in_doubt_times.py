"""When each send happened, and the oldest send still in doubt

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 22:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # the start of the step whose request may be on the wire (set by every claim): never
    # later than the send itself, so a doubt counted from it is never too young
    op.add_column("transactions", sa.Column("dispatched_at", sa.DateTime(timezone=True)))
    # the oldest send whose outcome is not known (a timeout, a lost response, a 409, an odd
    # 2xx, a crash mid-send); NULL when nothing is in doubt. A lookup 404 proves "never
    # applied" only while it is younger than the gateway's key retention
    op.add_column("transactions", sa.Column("doubt_since", sa.DateTime(timezone=True)))
    # rows in doubt before this revision: their first send can be no older than the row
    op.execute(
        "UPDATE transactions SET doubt_since = created_at"
        " WHERE status IN ('dispatching', 'unknown')"
    )


def downgrade() -> None:
    op.drop_column("transactions", "doubt_since")
    op.drop_column("transactions", "dispatched_at")
