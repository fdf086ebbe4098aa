"""Every link in README.md and docs/*.md points at a file of this repository.

What counts as a reference:

- a markdown link ``[text](target)`` (images too) or a reference definition
  ``[id]: target``, resolved against the file that contains it (``/x`` from the repo root);
- a backticked path in a table row that looks like a repository file: it contains a ``/``
  and ends in a file suffix (``docs/processing.md``, ``bench/locks.py --flag``: the first
  word), resolved against the repository root or the containing file;
- a backticked ``*.md`` page anywhere (``docs/architecture.md``, ``gateway.md``), resolved
  the same way: this is how the docs refer to each other in prose.

Skipped: http(s) and mailto links, pure ``#anchors``, fenced code blocks, links inside code
spans. A ``#fragment`` is stripped. A target outside the repository (``../shared/x.md``)
is dead even if it exists on this machine: a fresh clone does not have it.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]

# [text](target) or [text](<target> "title"); the text may hold one level of brackets
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"
    r"\(\s*(<[^<>\n]*>|[^\s()<>]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^()]*\)))?\s*\)"
)
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^<>\n]*>|\S+)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
EXTERNAL = re.compile(r"^(?:https?|mailto):", re.IGNORECASE)
# a relative path: no spaces, globs, braces or colons
PATH = re.compile(r"(?:\.{1,2}/)*[\w.-]+(?:/[\w.-]+)*")
FILE_SUFFIXES = frozenset(
    {".md", ".py", ".json", ".yml", ".yaml", ".toml", ".ini", ".cfg", ".txt", ".lua", ".sh"}
    | {".sql", ".mako", ".html", ".csv"}
)


@dataclass(frozen=True, slots=True)
class Ref:
    """One reference found in a markdown file."""

    source: Path
    line: int
    target: str
    kind: str  # "link" (markdown) or "path" (backticked)


def doc_files(root: Path) -> list[Path]:
    """README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def references(doc: Path) -> Iterator[Ref]:
    """Every link and file-like backticked path of ``doc``, outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        opening = FENCE.match(line)
        if opening:
            mark = opening.group(1)
            if fence is None:
                fence = mark
            elif mark[0] == fence[0] and len(mark) >= len(fence):
                fence = None
            continue
        if fence is not None:
            continue
        spans = [m.group(2).strip() for m in CODE_SPAN.finditer(line)]
        prose = CODE_SPAN.sub("", line)  # a link inside a code span is not a link
        for m in INLINE_LINK.finditer(prose):
            yield Ref(doc, number, m.group(1).strip("<>"), "link")
        definition = REFERENCE_DEF.match(prose)
        if definition:
            yield Ref(doc, number, definition.group(1).strip("<>"), "link")
        in_table = line.lstrip().startswith("|")
        for span in spans:
            words = span.split()
            if not words or not PATH.fullmatch(words[0]):
                continue
            word = words[0]
            suffix = Path(word).suffix
            if suffix == ".md" or (in_table and "/" in word and suffix in FILE_SUFFIXES):
                yield Ref(doc, number, word, "path")


def problem(ref: Ref, root: Path) -> str | None:
    """Why ``ref`` does not resolve to a file of the repository, or None when it does."""
    target = ref.target
    if ref.kind == "link" and (EXTERNAL.match(target) or target.startswith("#")):
        return None
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    if not path:
        return None
    root = root.resolve()
    if path.startswith("/"):
        candidates = [root / path.lstrip("/")]
    elif ref.kind == "link":
        candidates = [ref.source.parent / path]
    else:
        candidates = [root / path, ref.source.parent / path]
    inside = [c.resolve() for c in candidates if c.resolve().is_relative_to(root)]
    if any(c.exists() for c in inside):
        return None
    why = "no such file" if inside else "outside the repository"
    return f"{ref.source.resolve().relative_to(root)}:{ref.line}: {target} ({why})"


def dead_links(root: Path) -> list[str]:
    """Every reference of README.md and docs/*.md that does not resolve."""
    found = (problem(ref, root) for doc in doc_files(root) for ref in references(doc))
    return [p for p in found if p is not None]


def test_every_link_in_the_docs_resolves() -> None:
    refs = [ref for doc in doc_files(ROOT) for ref in references(doc)]
    assert len(refs) > 20, f"only {len(refs)} references found: is the parser broken?"
    dead = dead_links(ROOT)
    assert not dead, "links to files that are not in the repository:\n" + "\n".join(dead)


def test_readme_lists_the_architecture_and_the_protocol() -> None:
    targets = {ref.target for ref in references(ROOT / "README.md")}
    assert {"docs/architecture.md", "docs/gateway-protocol.md"} <= targets


def test_the_checker_finds_dead_links_and_only_those(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "bench").mkdir()
    (root / "docs" / "a.md").write_text("# A\n")
    (root / "bench" / "x.py").write_text("")
    (tmp_path / "outside.md").write_text("exists, but not in the repository\n")
    (root / "README.md").write_text(
        textwrap.dedent(
            """\
            [good](docs/a.md#top) [dead](docs/missing.md) [web](https://example.com/x.md)
            [mail](mailto:a@example.com) [anchor](#usage) ![img](<docs/img.png> "title")
            [outside](../outside.md)
            Prose: `docs/a.md`, `docs/gone.md`; `bench/prose-only.py` is not checked here.
            | page | what |
            | --- | --- |
            | `docs/a.md` | fine |
            | `bench/x.py --flag` | fine: the first word is the path |
            | `bench/nope.py` | dead |
            | `pw:lock:{acct}`, `GET /_sim/ledger`, `docs/` | not file paths |
            ```
            [in a fence](docs/nothing.md) `docs/nothing.md`
            ```
            `[in a code span](docs/nothing.md)`
            [ref]: docs/gone-ref.md
            """
        )
    )
    (root / "docs" / "b.md").write_text(
        "[up](../README.md) [sibling](a.md) `a.md` [rooted](/docs/a.md) [gone](c.md)\n"
    )
    assert dead_links(root) == [
        "README.md:1: docs/missing.md (no such file)",
        "README.md:2: docs/img.png (no such file)",
        "README.md:3: ../outside.md (outside the repository)",
        "README.md:4: docs/gone.md (no such file)",
        "README.md:9: bench/nope.py (no such file)",
        "README.md:15: docs/gone-ref.md (no such file)",
        "docs/b.md:1: c.md (no such file)",
    ]
