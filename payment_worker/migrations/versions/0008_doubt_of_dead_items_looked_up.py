"""Dead items that were looked up before revision 0003 get the time their doubt began

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 14:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Before 0003 a lookup's 404 was taken as "never applied" at any age, also after the
    # gateway had forgotten the key of a payment it made. Such an item was sent again under
    # that key or, its attempts used up, died `retries_exhausted` with its key "not_applied":
    # 0006 (unknown_unresolved, or a key "sent") did not date it, and `dlq replay` let it
    # through, to a 404 and a second payment. An item that was ever looked up was in doubt
    # once: dated like 0006's rows, from the row itself. One that a 404 within the key trust
    # cleared since (doubt_since NULL too) is dated as well: its replay, past the key trust,
    # is then for a person to decide, never a resend
    op.execute(
        """
        UPDATE transactions SET doubt_since = created_at
        WHERE status = 'dead' AND doubt_since IS NULL AND lookups > 0
        """
    )


def downgrade() -> None:
    # the times set above are kept: a doubt dated is never less safe than one not dated
    pass
