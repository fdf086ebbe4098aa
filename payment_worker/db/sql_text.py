"""SQL text as it is sent: the source's comments and layout dropped.

The drain's statements are long CTEs, written with comments and indentation for the reader.
psycopg converts a statement's ``%(name)s`` placeholders on every execution unless the text
is at most 4,096 characters long (``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH``: it
caches the conversion of shorter texts only); the layout alone put the drain's last
statement past that. :func:`compact` keeps what Postgres reads and drops the rest.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

# psycopg caches the conversion of statement texts up to this length (see the module)
PSYCOPG_CACHED_LENGTH = 4096


def compact(sql: str) -> str:
    """``sql`` without ``--`` comments, each run of white space outside quotes one space.

    Quoted text (``'...'`` literals, ``"..."`` identifiers, with their doubled quotes) is
    copied as it is. Block comments and dollar quoting are refused (ValueError): the
    service's statements use neither, and a scanner that knew them would be larger than
    this one.
    """
    out: list[str] = []
    i, n = 0, len(sql)
    space = False
    while i < n:
        c = sql[i]
        if c in "'\"":
            end = i + 1
            while True:
                end = sql.find(c, end)
                if end < 0:
                    raise ValueError(f"unterminated quote at {i}")
                if end + 1 < n and sql[end + 1] == c:
                    end += 2  # a doubled quote inside the quoted text
                    continue
                break
            if space and out:
                out.append(" ")
            space = False
            out.append(sql[i : end + 1])
            i = end + 1
        elif sql.startswith("--", i):
            nl = sql.find("\n", i)
            i = n if nl < 0 else nl
            space = True
        elif sql.startswith("/*", i) or c == "$":
            raise ValueError(f"block comments and dollar quoting are not supported (at {i})")
        elif c.isspace():
            space = True
            i += 1
        else:
            if space and out:
                out.append(" ")
            space = False
            out.append(c)
            i += 1
    return "".join(out)


def compact_text(sql: str) -> TextClause:
    """:func:`compact`, as a SQLAlchemy ``text()`` statement."""
    return text(compact(sql))
