"""The code blocks of one README section, so a test can run exactly what the README shows."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def section(title: str) -> str:
    """The text of the README section headed ``title`` (any level), up to the next heading of the same or a
    higher level."""
    text = README.read_text()
    match = re.search(rf"^(#+) {re.escape(title)}\s*$", text, re.MULTILINE)
    assert match, f"README has no section {title!r}"
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
    assert len(found) == 1, f"README section {title!r}: {len(found)} {language} blocks start with {first_line!r}"
    return found[0]


def _without_fences(text: str) -> str:
    """``text`` with every fenced block blanked out (same length), so a ``# comment`` in a block is no heading."""
    return _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
