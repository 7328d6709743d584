"""Every relative link in the docs leads somewhere: README.md, docs/*.md and benchmarks/results/*.md link to files
that exist, and their #anchors to headings those files have, by GitHub's rule (lowercase, spaces to '-',
punctuation removed, a repeated heading numbered -1, -2, ...). External http(s) links are not fetched."""

import re
from pathlib import Path

import pytest
from helpers import REPO_ROOT

DOCUMENTS = sorted([REPO_ROOT / "README.md", *REPO_ROOT.glob("docs/*.md"), *REPO_ROOT.glob("benchmarks/results/*.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def without_code(text: str) -> str:
    """The text with its code blocks gone and its code spans reduced to their content's words (a link's text may
    be code; a link inside code is no link)."""
    text = FENCE.sub("", text)
    return INLINE_CODE.sub(lambda match: re.sub(r"[\[\]()]", "", match.group(0).strip("`")), text)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: its rendered words (links' and code's text kept, emphasis marks
    dropped), lowercase, punctuation removed, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    found, seen = set(HTML_ANCHOR.findall(text)), {}
    for _, heading in HEADING.findall(text):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    text = without_code(path.read_text(encoding="utf-8"))
    targets = LINK.findall(text) + REFERENCE.findall(text)
    return [target for target in targets if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)]


def broken_link(document: Path, target: str) -> str | None:
    """Why `target` (a relative link in `document`) leads nowhere; None if it leads to its file and anchor."""
    address, _, anchor = target.partition("#")
    destination = (document.parent / address).resolve() if address else document
    if not destination.exists():
        return f"{target}: no {destination.relative_to(REPO_ROOT) if destination.is_relative_to(REPO_ROOT) else destination}"
    if anchor and destination.suffix == ".md" and anchor not in anchors(destination):
        return f"{target}: no heading of {destination.name} has the anchor #{anchor}"
    return None


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(REPO_ROOT).as_posix())
def test_every_relative_link_leads_to_its_file_and_heading(document):
    problems = [problem for target in relative_links(document) if (problem := broken_link(document, target))]
    assert not problems, "\n".join(problems)


def test_the_anchor_rule_is_githubs():
    """Anchors as GitHub renders them for headings of these docs' kinds."""
    assert github_anchor("Real text: BAM against ALiBi, NoPE, RoPE and RoPE local") == (
        "real-text-bam-against-alibi-nope-rope-and-rope-local")
    assert github_anchor("One run per output folder") == "one-run-per-output-folder"
    assert github_anchor("`bam-eval passkey`: the **strict** score (95% interval)") == (
        "bam-eval-passkey-the-strict-score-95-interval")
    assert github_anchor("Step 1 - install") == "step-1---install"
    assert github_anchor("Adding a [positional variant](x.md)") == "adding-a-positional-variant"


def test_a_broken_link_and_a_broken_anchor_are_found(tmp_path):
    (tmp_path / "page.md").write_text("# Page\n\n## A heading\n\n## A heading\n")
    document = tmp_path / "doc.md"
    document.write_text("[ok](page.md#a-heading-1) [gone](missing.md) [bad](page.md#b-heading) `[code](nowhere.md)`\n"
                        "```\n[fenced](nowhere.md)\n```\n[web](https://example.com/x) [self](#top)\n# Top\n")
    problems = [problem for target in relative_links(document) if (problem := broken_link(document, target))]
    assert len(problems) == 2 and "missing.md" in problems[0] and "#b-heading" in problems[1], problems
