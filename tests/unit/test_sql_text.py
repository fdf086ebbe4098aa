"""The drain's SQL as sent: comments and layout dropped, quoted text kept, short enough for
psycopg to cache its placeholder conversion (db/sql_text.py)."""

from __future__ import annotations

import pytest
from psycopg import _queries
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

from payment_worker.db import work
from payment_worker.db.sql_text import PSYCOPG_CACHED_LENGTH, compact


def test_comments_and_layout_go_and_quoted_text_stays() -> None:
    sql = """
    SELECT a,   -- the first column
           'x  -- not a comment', "odd  ""name"" --"
    FROM t   -- the table
    WHERE b = 'it''s  two'
    """
    assert compact(sql) == (
        "SELECT a, 'x  -- not a comment', \"odd  \"\"name\"\" --\" FROM t WHERE b = 'it''s  two'"
    )


def test_a_comment_on_the_last_line_and_no_trailing_space() -> None:
    assert compact("SELECT 1 -- done") == "SELECT 1"
    assert compact("  SELECT\n\t1  ") == "SELECT 1"


@pytest.mark.parametrize("sql", ["SELECT 1 /* x */", "SELECT $$a$$", "SELECT 'open"])
def test_what_the_scanner_does_not_know_is_refused(sql: str) -> None:
    with pytest.raises(ValueError):
        compact(sql)


def test_the_limit_is_psycopgs() -> None:
    # if psycopg changes its limit, the statements' budget below must follow it
    assert _queries.MAX_CACHED_STATEMENT_LENGTH == PSYCOPG_CACHED_LENGTH


@pytest.mark.parametrize(
    "name",
    [
        "_CLAIM",
        "_FENCE_AND_CLAIM",
        "_RECORD",
        "_RECORD_AND_FINISH",
        "_COMPLETE",
        "_COMPLETE_AND_NEXT_DUE",
    ],
)
def test_each_drain_statement_fits_psycopgs_cache(name: str) -> None:
    stmt = getattr(work, name)
    sent = stmt.sql  # what the drain sends (db/driver.py): :name -> %(name)s
    # the same text SQLAlchemy sends for the statement on its own connections
    assert sent == str(stmt.clause.compile(dialect=pg_psycopg.dialect()))
    assert "%(" in sent and "--" not in sent
    assert len(sent) <= PSYCOPG_CACHED_LENGTH, (name, len(sent))
