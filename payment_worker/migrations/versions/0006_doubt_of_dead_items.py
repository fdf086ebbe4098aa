"""Dead items that were in doubt before revision 0003 get the time their doubt began

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 04:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # 0003 dated the doubt of the items open then (dispatching, unknown), not of those already
    # dead in doubt (unknown_unresolved, or a key last recorded "sent"). With doubt_since NULL
    # such an item read as "never in doubt": `dlq replay` let it through at any age, and a
    # lookup 404 long past the gateway's key retention would have sent it again. Dated like
    # 0003's rows, from the row itself, which is never later than its first send (so its
    # doubt is never counted too young)
    op.execute(
        """
        UPDATE transactions t SET doubt_since = t.created_at
        WHERE t.status = 'dead' AND t.doubt_since IS NULL
          AND (EXISTS (SELECT 1 FROM dead_letters d
                       WHERE d.transaction_pk = t.id AND d.reason = 'unknown_unresolved')
               OR EXISTS (SELECT 1 FROM idempotency_keys k
                          WHERE k.transaction_pk = t.id AND k.status = 'sent'))
        """
    )


def downgrade() -> None:
    # the times set above are kept: a doubt dated is never less safe than one not dated
    pass
