"""The documentation site builds, strictly: every page in the nav, every link to a page or anchor that exists
(mkdocs.yml's validation settings turn each of those into a warning, and strict mode into a failure). README.md,
the front page, links into docs/ only to pages that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    built = {p.relative_to(tmp_path / "site").parts[0] for p in (tmp_path / "site").glob("*/index.html")}
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert built >= pages


def test_the_readme_links_to_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(links) > 10
    assert [link for link in links if not (ROOT / link).is_file()] == []
