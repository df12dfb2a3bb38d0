"""The code blocks of one section of the README or of a page under ``docs/``, so a test can run exactly what the
documentation shows. A section is found by its heading in whichever document holds it (each heading a test names
is in exactly one), so a test keeps working when its section moves between README and a docs page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def documents() -> list[Path]:
    """README and every Markdown page of the documentation site."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def section(title: str) -> str:
    """The text of the section headed ``title`` (any level), up to the next heading of the same or a higher level,
    in the one document (README or a docs page) that has it."""
    heading = re.compile(rf"^(#+) {re.escape(title)}\s*$", re.MULTILINE)
    found = [(path, match) for path in documents()
             for match in [heading.search(_without_fences(path.read_text()))] if match]
    assert len(found) == 1, f"{len(found)} documents have a section {title!r}: {[str(p) for p, _ in found]}"
    path, match = found[0]
    text = path.read_text()
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", _without_fences(rest), re.MULTILINE)
    return rest[: end.start()] if end else rest


def blocks(title: str, language: str) -> list[str]:
    """Every fenced block of ``language`` in the section, in order, without its fences."""
    return [body for lang, body in _FENCE.findall(section(title)) if lang == language]


def block_starting(title: str, language: str, first_line: str) -> str:
    """The one block of ``language`` in the section whose first line is ``first_line``."""
    found = [b for b in blocks(title, language) if b.splitlines()[0].strip() == first_line]
    assert len(found) == 1, f"section {title!r}: {len(found)} {language} blocks start with {first_line!r}"
    return found[0]


def all_blocks(path: Path, language: str) -> list[str]:
    """Every fenced block of ``language`` in one document, in order, without its fences."""
    return [body for lang, body in _FENCE.findall(path.read_text()) if lang == language]


def _without_fences(text: str) -> str:
    """``text`` with every fenced block blanked out (same length), so a ``# comment`` in a block is no heading."""
    return _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
