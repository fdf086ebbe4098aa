"""The service's Redis Lua scripts, one ``.lua`` file each, and their loader.

Each script starts with a comment header naming its ``KEYS``, ``ARGV`` and return values.
Code shared by several scripts lives once in ``lib/<name>.lua`` and is pulled in by a line
``-- #include <name>``, which :func:`load` replaces with that file's text (Lua needs a
``local function`` defined before its first use, so includes sit above the script body).
The callers read their scripts once, into module constants, when they are imported.
"""

from __future__ import annotations

import re
from importlib import resources

# a whole line; a lib file may not include another (one level keeps the expansion obvious)
_INCLUDE = re.compile(r"^-- #include ([a-z][a-z0-9_]*)[ \t]*$", re.MULTILINE)
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _read(*parts: str) -> str:
    if not all(_NAME.fullmatch(part) for part in parts):
        raise ValueError(f"not a Lua script name: {'/'.join(parts)!r}")
    path = resources.files(__name__)
    for part in parts[:-1]:
        path = path / part
    return (path / f"{parts[-1]}.lua").read_text(encoding="utf-8")


def _lib(name: str) -> str:
    text = _read("lib", name)
    if _INCLUDE.search(text):
        raise ValueError(f"lib/{name}.lua includes another file; only scripts may include")
    # the directive's own line break stays after the expansion
    return text.rstrip("\n")


def load(name: str) -> str:
    """The source of ``payment_worker/lua/<name>.lua`` with its ``-- #include`` lines expanded.

    Raises :class:`ValueError` for a malformed name and :class:`FileNotFoundError` for a
    script or lib file that does not exist.
    """
    return _INCLUDE.sub(lambda m: _lib(m.group(1)), _read(name))
