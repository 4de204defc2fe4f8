"""The results folders stay auditable: each has a README, the index lists each, and every link to
a results folder from the README, the status page or another result resolves to one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
FOLDERS = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
# a results folder named in a link or in backquotes: 2026-12-07-some-claim(-card)/
_FOLDER_REF = re.compile(r"results/(\d{4}-\d{2}-\d{2}-[A-Za-z0-9.-]+)/")


def test_there_are_results():
    assert len(FOLDERS) >= 10


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_result_has_a_readme_and_an_index_row(folder):
    assert (RESULTS / folder / "README.md").is_file(), f"docs/results/{folder} has no README.md"
    index = (RESULTS / "README.md").read_text()
    assert f"`{folder}/`" in index, f"docs/results/README.md does not list {folder}/"


@pytest.mark.parametrize("doc", ["README.md", "docs/status.md", *(f"docs/results/{f}/README.md" for f in FOLDERS)])
def test_links_to_results_resolve(doc):
    path = ROOT / doc
    if not path.is_file():
        pytest.skip(f"{doc} absent")
    missing = sorted({m for m in _FOLDER_REF.findall(path.read_text()) if not (RESULTS / m).is_dir()})
    assert not missing, f"{doc} points at results folders that do not exist: {missing}"


def _readme_measured_blocks() -> list[str]:
    """The README's "Measured" section split into paragraphs, bullets and table rows."""
    text = (ROOT / "README.md").read_text()
    start = text.index("Measured, like for like")
    section = text[start:text.index("\n## ", start)]
    blocks: list[str] = []
    for line in section.splitlines():
        if not line.strip():
            blocks.append("")
        elif line.startswith(("- ", "|")) or not blocks:
            blocks.append(line)
        else:
            blocks[-1] += "\n" + line
    return [b for b in blocks if b.strip()]


_FIGURE = re.compile(r"\d\.\d")
_VERSION = re.compile(r"\b(torch|cuDNN|flash-attn-4|Triton|Python) [\d.a-z]+")  # a version is no figure


def test_every_figure_in_the_readme_has_a_results_folder():
    """Issue 33: no measured claim in the README without a results folder behind it.  A paragraph,
    bullet or table row with a figure links a results folder (a table row may say "same": the
    row above's folder)."""
    blocks = _readme_measured_blocks()
    assert len(blocks) >= 8
    unbacked = []
    for block in blocks:
        if not _FIGURE.search(_VERSION.sub("", block)) or set(block.replace("|", "").strip()) <= set("-: "):
            continue
        if block.startswith("|") and block.rstrip(" |").rsplit("|", 1)[-1].strip() == "same":
            continue
        if not _FOLDER_REF.search(block):
            unbacked.append(block.splitlines()[0][:80])
    assert not unbacked, f"README figures without a results folder: {unbacked}"
