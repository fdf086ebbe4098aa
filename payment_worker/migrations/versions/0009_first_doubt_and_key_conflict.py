"""The first send of a transaction ever in doubt, and a key the gateway held another body under

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 18:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_OLD_KEY_STATUSES = "'new', 'sent', 'applied', 'declined', 'rejected', 'not_applied'"


def upgrade() -> None:
    # A lookup's 404 clears an item's doubt, and it is sent again under its key; but the
    # send that was in doubt may still land after that 404 (a paused holder's), and once the
    # gateway has forgotten the key a later send pays a second time. So the first send ever
    # in doubt is dated for good, and past the key trust the item is never sent again
    # automatically. Nullable, no default: added without rewriting the table
    op.add_column("transactions", sa.Column("first_doubt_at", sa.DateTime(timezone=True)))
    # open items: an item ever looked up was in doubt once, dated from its creation (as 0008
    # did for dead ones): its doubt now may be a later one, an earlier one cleared by a 404;
    # one never looked up from its doubt. Dead items are dated the same way when read
    # (DOUBT_SINCE in db/dead_letters.py)
    op.execute(
        """
        UPDATE transactions
        SET first_doubt_at = CASE WHEN lookups > 0 THEN created_at ELSE doubt_since END
        WHERE status IN ('pending', 'retryable', 'dispatching', 'unknown')
          AND (doubt_since IS NOT NULL OR lookups > 0)
        """
    )
    # 'conflict': a 422 whose lookup got no final answer yet; remembered so that a 404 after
    # it goes to a person instead of a resend
    op.execute(
        f"""
        ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_check,
        ADD CONSTRAINT idempotency_keys_status_check
            CHECK (status IN ({_OLD_KEY_STATUSES}, 'conflict')) NOT VALID
        """
    )
    op.execute("ALTER TABLE idempotency_keys VALIDATE CONSTRAINT idempotency_keys_status_check")


def downgrade() -> None:
    # a key in conflict may have been applied: "sent" is the old schema's nearest
    op.execute("UPDATE idempotency_keys SET status = 'sent' WHERE status = 'conflict'")
    op.execute(
        f"""
        ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_check,
        ADD CONSTRAINT idempotency_keys_status_check CHECK (status IN ({_OLD_KEY_STATUSES}))
        """
    )
    op.drop_column("transactions", "first_doubt_at")
