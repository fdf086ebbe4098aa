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
    # The items there are: one ever looked up was in doubt once (or was replayed: nothing
    # before this column tells the two apart, and a person decides rather than a guess), dated
    # from its creation, as 0008 did for dead ones (its doubt now may be a later one, an
    # earlier one cleared by a 404); one never looked up from its doubt. From here on the
    # column alone tells (DOUBT_SINCE in db/dead_letters.py). The whole run is one
    # transaction, and the column's ACCESS EXCLUSIVE lock is held to its end: each fill reads
    # a bounded set, never the whole table. Open items, through the partial index on them:
    op.execute(
        """
        UPDATE transactions
        SET first_doubt_at = CASE WHEN lookups > 0 THEN created_at ELSE doubt_since END
        WHERE status NOT IN ('succeeded', 'failed', 'dead')
          AND (doubt_since IS NOT NULL OR lookups > 0)
        """
    )
    # dead items, through their dead letters (every dead transaction has one)
    op.execute(
        """
        UPDATE transactions t
        SET first_doubt_at = CASE WHEN t.lookups > 0 THEN t.created_at ELSE t.doubt_since END
        FROM (SELECT DISTINCT transaction_pk FROM dead_letters
              WHERE transaction_pk IS NOT NULL) d
        WHERE t.id = d.transaction_pk AND t.status = 'dead'
          AND (t.doubt_since IS NOT NULL OR t.lookups > 0)
        """
    )
    # 'conflict': a 422 whose lookup got no final answer yet; remembered so that a 404 after
    # it goes to a person instead of a resend. NOT VALID and not validated: every row holds
    # one of the old values, which the new check allows, and a validation in this run's one
    # transaction would read every key under the table's ACCESS EXCLUSIVE lock (new and
    # changed rows are checked all the same)
    op.execute(
        f"""
        ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_check,
        ADD CONSTRAINT idempotency_keys_status_check
            CHECK (status IN ({_OLD_KEY_STATUSES}, 'conflict')) NOT VALID
        """
    )


def downgrade() -> None:
    # a key in conflict may have been applied: "sent" is the old schema's nearest
    op.execute("UPDATE idempotency_keys SET status = 'sent' WHERE status = 'conflict'")
    op.execute(
        f"""
        ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_check,
        ADD CONSTRAINT idempotency_keys_status_check CHECK (status IN ({_OLD_KEY_STATUSES}))
            NOT VALID
        """
    )
    op.drop_column("transactions", "first_doubt_at")
