"""The docs hold together: every relative link in README.md, docs/ and the other READMEs
names a file that exists and, for a Markdown file, a heading it has; the README stays a
front page (at most 300 lines, the detail in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "cluster" / "README.md", *sorted((REPO / "docs").glob("*.md")),
        REPO / "experiments" / "examples" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # '#' in code is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_names_a_file_and_heading_that_exist():
    broken = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                name, _, anchor = target.partition("#")
                path = (doc.parent / name).resolve() if name else doc
                where = f"{doc.relative_to(REPO)}:{n}: {target}"
                if not path.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                    broken.append(f"{where} (no such heading in {path.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"
    # The two set-up commands come first; what a worker's death does is said in one place.
    assert lines[3].startswith("make train ") and lines[4].startswith("make test "), lines[:6]
    assert sum(line.startswith("## What happens when a worker dies") for line in lines) == 1
