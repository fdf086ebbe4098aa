"""The Lua scripts: one file each, with a header, includes expanded, none left inline in Python."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from payment_worker import lua

PACKAGE = Path(__file__).resolve().parents[2] / "payment_worker"
LUA_DIR = PACKAGE / "lua"
SCRIPTS = sorted(p.stem for p in LUA_DIR.glob("*.lua"))
LIBS = sorted(p.stem for p in (LUA_DIR / "lib").glob("*.lua"))
SLOT = re.compile(r"\b(KEYS|ARGV)\[(\d+)\]")


def header(text: str) -> str:
    """The leading block of comment lines."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line)
    return "\n".join(lines)


def code(text: str) -> str:
    """The text without comment lines."""
    return "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("--"))


def test_the_scripts_are_there() -> None:
    assert SCRIPTS == [
        "account_end",
        "account_start",
        "broker_take",
        "holder_register",
        "holders_prune",
        "lock_cancel",
        "lock_leave",
        "lock_release",
        "lock_renew",
        "lock_take",
        "lock_takeover",
        "lock_wait",
        "pace_acquire",
        "pace_cooldown",
        "queued_mark",
        "schedule_claim",
        "schedule_clear",
        "token_claim",
        "token_release",
        "token_store",
    ]
    assert LIBS == [
        "lock_queue",
        "lock_release",
        "lock_take",
        "now_ms",
        "pace_lease",
        "pace_return",
        "token_claim",
        "token_release",
        "unacked_record",
    ]


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_has_a_header_naming_its_keys_argv_and_returns(name: str) -> None:
    raw = (LUA_DIR / f"{name}.lua").read_text(encoding="utf-8")
    head = header(raw)
    assert head.startswith(f"-- {name}: "), "the first line names the script and says what it does"
    assert re.search(r"^-- Returns ", head, re.MULTILINE)
    named = {m.group(0) for m in SLOT.finditer(head)}
    used = {m.group(0) for m in SLOT.finditer(code(lua.load(name)))}
    assert "KEYS[1]" in named and "ARGV[1]" in named
    assert used <= named, f"KEYS/ARGV used but not described in the header: {used - named}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_includes_are_expanded(name: str) -> None:
    source = lua.load(name)
    assert "#include" not in source
    assert "redis.call(" in source
    raw = (LUA_DIR / f"{name}.lua").read_text(encoding="utf-8")
    for lib in re.findall(r"^-- #include (\w+)$", raw, re.MULTILINE):
        assert (LUA_DIR / "lib" / f"{lib}.lua").read_text(encoding="utf-8").strip() in source


@pytest.mark.parametrize("name", LIBS)
def test_lib_has_a_header_naming_what_it_defines(name: str) -> None:
    raw = (LUA_DIR / "lib" / f"{name}.lua").read_text(encoding="utf-8")
    head = header(raw)
    assert head.startswith(f"-- lib/{name}: ")
    assert "#include" not in raw, "only scripts include"
    defined = re.findall(r"^local function (\w+)\(", raw, re.MULTILINE)
    assert defined
    for fn in defined:
        assert fn in head


def test_shared_lua_is_written_once() -> None:
    sources = [(LUA_DIR / f"{n}.lua").read_text(encoding="utf-8") for n in SCRIPTS]
    for text in sources:
        # the server-time snippet and the queue helpers come only from lib/
        assert "redis.call('TIME')" not in text
        assert "local function" not in text
    included = {lib for t in sources for lib in re.findall(r"^-- #include (\w+)$", t, re.M)}
    assert included == set(LIBS), "every lib file is used"


def test_every_script_is_loaded_by_the_package() -> None:
    py = "\n".join(p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py"))
    loaded = set(re.findall(r"""lua\.load\(["'](\w+)["']\)""", py))
    assert loaded == set(SCRIPTS)


def test_no_lua_left_in_python() -> None:
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if "redis.call(" in p.read_text(encoding="utf-8")
    ]
    assert offenders == []


@pytest.mark.parametrize("bad", ["../settings", "lib/now_ms", "Lock_Wait", "", "x.lua"])
def test_load_takes_plain_names_only(bad: str) -> None:
    with pytest.raises(ValueError, match="not a Lua script name"):
        lua.load(bad)


def test_load_of_a_missing_script_fails() -> None:
    with pytest.raises(FileNotFoundError):
        lua.load("no_such_script")
