"""The README's and docs' promises that code can check: the config reference, the test command,
the README's size, its links and its file tree of rlscale/."""

import re
from pathlib import Path

import pytest

from rlscale.config import reference_table

ROOT = Path(__file__).resolve().parents[1]
README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))

MAX_README_LINES = 250
MAX_LINE_CHARS = 120  # every line shorter than this


def test_config_reference_in_docs_matches_the_code():
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    assert reference_table() in configuration, (
        "docs/configuration.md's config reference differs from the code: replace the table under "
        "its '## Reference' heading with the output of `rlscale config`")


def test_readme_links_to_the_config_reference():
    assert "(docs/configuration.md)" in README


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/run" in README
    assert "python -m pytest -n 2 -q" in ci and "python -m pytest -n 2 -q" in README


def test_readme_is_short():
    lines = README.splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, at most {MAX_README_LINES}: move detail into docs/")
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) >= MAX_LINE_CHARS]
    assert not long, f"README.md lines of {MAX_LINE_CHARS} characters or more (line, length): {long}"


LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def split_fenced(text: str) -> tuple[str, list[list[str]]]:
    """(the text outside ``` code blocks, the lines of each code block)."""
    outside, blocks, block = [], [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
        elif block is None:
            outside.append(line)
        else:
            block.append(line)
    return "\n".join(outside), blocks


def relative_links(text: str) -> list[str]:
    """Targets of Markdown links outside code blocks that are neither URLs nor in-page anchors."""
    text, _ = split_fenced(text)
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto: ...; an anchor in the same page
        targets.append(target)
    return targets


def test_link_parser():
    text = ("[a](docs/x.md) [b](https://e.org/y) [c](#here) [d](../z.md#part) [e](w.md \"title\")\n"
            "```\n[f](in/code.md)\n```\n")
    assert relative_links(text) == ["docs/x.md", "../z.md#part", "w.md"]


@pytest.mark.parametrize("page", [README_PATH, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(page):
    missing = []
    for target in relative_links(page.read_text()):
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


TREE_LINE = re.compile(r"^((?:│   |    )*)(?:├── |└── )(\S+)")


def readme_tree(text: str) -> set[str]:
    """Paths (relative to rlscale/) named in the README's file tree: the code block whose first
    line is `rlscale/`, drawn with ├── / └── and four characters per level."""
    for lines in split_fenced(text)[1]:
        if lines and lines[0].strip() == "rlscale/":
            break
    else:
        raise AssertionError("README.md has no file tree: a code block starting with the line `rlscale/`")
    names, stack = set(), []
    for line in lines[1:]:
        match = TREE_LINE.match(line)
        if not match:
            continue
        depth = len(match.group(1)) // 4
        stack[depth:] = [match.group(2).rstrip("/")]
        names.add("/".join(stack))
    return names


def test_tree_parser():
    text = "```\nrlscale/\n├── a.py   one\n├── pkg/   two\n│   └── b.py  three\n└── c.py\n```\n"
    assert readme_tree(text) == {"a.py", "pkg", "pkg/b.py", "c.py"}


def package_modules() -> set[str]:
    """Every module (each .py but __init__.py) and subpackage of rlscale/, as on disk now."""
    package = ROOT / "rlscale"
    found = set()
    for path in package.rglob("*.py"):
        if "__pycache__" in path.parts or any(part.startswith(".") for part in path.parts):
            continue
        rel = path.relative_to(package)
        if path.name != "__init__.py":
            found.add(rel.as_posix())
        elif rel.parent != Path("."):
            found.add(rel.parent.as_posix())
    return found


def test_readme_tree_names_every_module():
    missing = sorted(package_modules() - readme_tree(README))
    assert not missing, f"README.md's file tree ('Where things are') lacks these modules of rlscale/: {missing}"


def test_readme_tree_names_only_what_exists():
    package = ROOT / "rlscale"
    stale = sorted(name for name in readme_tree(README) if not (package / name).exists())
    assert not stale, f"README.md's file tree names paths that rlscale/ no longer has: {stale}"
