"""The text of a ``jsonb`` parameter.

Postgres's ``jsonb`` (and ``text``) holds no NUL character: a ``\\u0000`` anywhere in a
document refuses the whole statement (22P05, not transient). What the service writes as
JSON can carry one from outside: a gateway's answer (a binary 502 body decoded with
replacement, a JSON string's ``"\\u0000"``), an exception's text, a message that does not
decode. Refused, a drain's chunk of outcomes went unwritten at every try, and a crash's
dead letter was retried without end; so every document is written through :func:`dumps`.
"""

from __future__ import annotations

import json
import re
from typing import Any

# a \u0000 escape in JSON text: preceded by an even number of backslashes (an odd one makes
# its backslash a literal one, the text "\u0000" itself, which Postgres takes)
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps(value, **kwargs)``, each NUL in its strings replaced by U+FFFD."""
    text = json.dumps(value, **kwargs)
    if "\\u0000" not in text:  # the common case: one scan, no regex
        return text
    return _NUL_ESCAPE.sub(r"\1\\ufffd", text)
