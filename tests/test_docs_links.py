"""The documentation stays true to the tree: every relative Markdown link in README.md and docs/
points at a file or folder that exists and, with an `#anchor`, at a heading of that page (GitHub's
slugs). The README stays short, and its two set-up commands are the ones CI runs. No network."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAIN_JOB = 'pip install torch==2.13.0 -e ".[dev]" && splitserve serve  # the main job'
TESTS = ('pip install torch==2.13.0 -e ".[dev]" && bash scripts/install_test_tools.sh && '
         'python -m pytest -q -n 2 -m "not serial" && python -m pytest -q -m serial  # the tests')
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")  # any indent: fences inside list items count too
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or ![alt](target), the target optionally followed by a "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http:", "https:", "mailto:")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w: letters, digits and underscore
    return text.replace(" ", "-")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None:
            closes = match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                and not match.group(2).strip()
            if closes:
                fence = None
        else:
            lines.append((number, line))
    return lines


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page, duplicates numbered -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code blocks and inline code."""
    found = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((number, match.group(1)))
    return found


def broken_link(page: Path, target: str) -> str | None:
    """Why a relative link is broken, or None when it is fine (or not relative)."""
    if not target or target.lower().startswith(EXTERNAL):
        return None
    path, _, anchor = target.partition("#")
    destination = (page.parent / path).resolve() if path else page
    if not destination.exists():
        return f"{path} does not exist"
    if anchor:
        if destination.is_dir() or destination.suffix.lower() != ".md":
            return f"#{anchor} points into {path}, which is not a Markdown page"
        if anchor not in anchors(destination):
            return f"{path or 'this page'} has no heading with the anchor #{anchor}"
    return None


def test_the_pages_exist():
    assert (ROOT / "docs" / "README.md").exists()
    assert len(PAGES) > 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    problems = [f"{page.relative_to(ROOT)}:{number}: ({target}) {why}"
                for number, target in links(page)
                if (why := broken_link(page, target))]
    assert not problems, "\n".join(problems)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_keeps_the_commands_ci_runs():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    main_job = [line for line in lines if line.endswith("# the main job")]
    tests = [line for line in lines if line.endswith("# the tests")]
    assert main_job and main_job[0] == MAIN_JOB
    assert tests and tests[0] == TESTS


@pytest.mark.parametrize("heading, expected", [
    ("`pools[].resources`", "poolsresources"),
    ("Baseline vs Sarathi-Serve vs Splitwise (CPU, measured)", "baseline-vs-sarathi-serve-vs-splitwise-cpu-measured"),
    ("`hardware_classes.<name>`", "hardware_classesname"),
    ("A request's life", "a-requests-life"),
    ("  Layers, and which way imports go ", "layers-and-which-way-imports-go"),
])
def test_slug_matches_github(heading, expected):
    assert slug(heading) == expected


def test_duplicate_headings_are_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n## Setup\n\n```\n## Setup\n```\n\n## Setup\n\n## Setup\n")
    assert anchors(page) == {"results", "setup", "setup-1", "setup-2"}


def test_links_in_code_are_ignored_and_broken_ones_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](other.md#other-page) [self](#title) [web](https://example.com/x)\n"
                    "`[code](missing.md)`\n\n```md\n[fenced](missing.md)\n```\n"
                    "[bad](missing.md) [bad anchor](other.md#nope)\n")
    found = links(page)
    assert [target for _, target in found] == ["other.md#other-page", "#title", "https://example.com/x",
                                               "missing.md", "other.md#nope"]
    assert [broken_link(page, target) is None for _, target in found] == [True, True, True, False, False]
