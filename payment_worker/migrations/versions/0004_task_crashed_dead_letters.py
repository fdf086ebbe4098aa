"""Dead letters of crashed tasks may name no batch and no transaction

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 22:40:00
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_OLD = "transaction_pk IS NOT NULL OR batch_pk IS NOT NULL"
# a task that crashed on a batch id that does not exist (or before reading one) has nothing
# to point at: only those rows may name neither
_NEW = _OLD + " OR reason = 'task_crashed'"


def upgrade() -> None:
    op.drop_constraint("dead_letters_ref_check", "dead_letters", type_="check")
    op.create_check_constraint("dead_letters_ref_check", "dead_letters", _NEW)


def downgrade() -> None:
    op.execute("DELETE FROM dead_letters WHERE transaction_pk IS NULL AND batch_pk IS NULL")
    op.drop_constraint("dead_letters_ref_check", "dead_letters", type_="check")
    op.create_check_constraint("dead_letters_ref_check", "dead_letters", _OLD)
