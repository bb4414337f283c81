"""The docs hold together: every relative link in README.md and docs/*.md points at a file that
exists, and every #anchor at a heading of that file (GitHub's heading slugs); the README stays a
page a newcomer reads in ten minutes."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
README_LINES = 250


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped (not '-' or '_'), spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # no headings in code
    found = set()
    for line in text.splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = 0
            while (slug if n == 0 else f"{slug}-{n}") in found:
                n += 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _links(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_exists(page):
    bad = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_slugs_are_githubs():
    assert _slug("bf16 on the CPU (`--dtype bfloat16`)") == "bf16-on-the-cpu---dtype-bfloat16"
    assert _slug("Several processes (torchrun)") == "several-processes-torchrun"
    assert _slug("The LoRA step's 1.4x: what it costs (Xeon, 2026-11-25)") == "the-lora-steps-14x-what-it-costs-xeon-2026-11-25"


def test_the_readme_is_short_and_links_every_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_LINES
    linked = {Path(t.partition("#")[0]).name for t in _links(ROOT / "README.md")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"README.md links none of {sorted(pages - linked)}"
