"""The documentation renders and its links resolve (issue 25: a code fence left open at
the README's install section swallowed the rest of the page, and a link pointed at a
design file outside the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_code_fences_close(doc: Path) -> None:
    opened: tuple[int, str] | None = None
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if not m:
            continue
        marks, rest = m.group(2), m.group(3)
        if opened is None:
            opened = (n, marks)
        elif marks.startswith(opened[1][0] * len(opened[1])):
            # CommonMark: a closing fence carries no text after it, or it does not close.
            assert not rest.strip(), f"{doc.name}:{n}: text after a closing fence: {line!r}"
            opened = None
    assert opened is None, f"{doc.name}:{opened[0]}: a code fence is never closed"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    in_fence = False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT), f"{doc.name}:{n}: {target} leaves the repository"
            assert path.exists(), f"{doc.name}:{n}: {target} does not exist"


def test_the_readme_names_every_client_dependency() -> None:
    """The README's install section names each dependency of kvstore-client (an engine's
    environment gets them all; atomicshm was missing from the list)."""
    import tomllib

    deps = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in deps["dependencies"]}
    text = (ROOT / "README.md").read_text()
    section = text[text.index("**`kvstore-client`**") : text.index("**`kvstore-cache`**")]
    missing = sorted(n for n in names if n not in section.lower())
    assert not missing, f"README's kvstore-client paragraph does not name: {missing}"
