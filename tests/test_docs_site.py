"""The built documentation site as a reader gets it: opened from disk, every
link lands on a page, and opening a page asks nothing of any other host
(no fonts, scripts or styles from a third party: an offline or private
install cannot reach one, and it would learn who reads these docs).

The site is built once, as `make docs` builds it, into a temporary dir.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).parent.parent

# What a browser fetches by itself when it opens a page: the attribute of
# each tag that names such a resource. An <a href> is fetched only when
# followed, and <link rel="canonical"> never.
FETCHED = {
    "script": ("src",),
    "img": ("src", "srcset"),
    "iframe": ("src",),
    "source": ("src", "srcset"),
    "video": ("src", "poster"),
    "audio": ("src",),
    "embed": ("src",),
    "object": ("data",),
    "link": ("href",),
}
NOT_FETCHED_LINKS = {"canonical", "alternate", "prev", "next"}
CSS_URL = re.compile(r"""url\(\s*["']?([^"')]+)|@import\s+["']([^"']+)""")


class Page(HTMLParser):
    """The URLs one page fetches when opened, and the ones it links to."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if tag == "a" and "href" in values:
            self.links.append(values["href"])
        if tag == "link" and set(values.get("rel", "").split()) <= NOT_FETCHED_LINKS:
            return
        for name in FETCHED.get(tag, ()):
            if name in values:
                # srcset: "url 2x, url 3x"; the URL is each part's first word.
                self.fetched += [part.split()[0] for part in values[name].split(",") if part]
        if "style" in values:
            self.fetched += [a or b for a, b in CSS_URL.findall(values["style"])]

    def handle_data(self, data: str) -> None:
        # An inline <style> block's url() and @import are fetched as well.
        if self.lasttag == "style":
            self.fetched += [a or b for a, b in CSS_URL.findall(data)]


def is_elsewhere(url: str) -> bool:
    """Whether fetching `url` from a page of the site reaches another host."""
    parts = urlsplit(url)
    return bool(parts.netloc) or parts.scheme not in ("", "data")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built from this checkout with warnings as errors."""
    target = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(target)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    return target


def pages(site: Path) -> dict[Path, Page]:
    parsed = {}
    for path in sorted(site.rglob("*.html")):
        page = Page()
        page.feed(path.read_text())
        parsed[path] = page
    return parsed


def test_opening_a_page_asks_nothing_of_another_host(site: Path) -> None:
    found = pages(site)
    assert len(found) >= 20
    elsewhere = {
        f"{path.relative_to(site)}: {url}"
        for path, page in found.items()
        for url in page.fetched
        if is_elsewhere(url)
    }
    # The theme's stylesheets and scripts, and what they import in turn.
    for sheet in site.rglob("*.css"):
        for a, b in CSS_URL.findall(sheet.read_text()):
            if is_elsewhere(a or b):
                elsewhere.add(f"{sheet.relative_to(site)}: {a or b}")
    assert not elsewhere, "\n".join(sorted(elsewhere))


def test_every_link_opened_from_disk_lands_on_a_page(site: Path) -> None:
    checked = 0
    for path, page in pages(site).items():
        if path.name == "404.html":
            continue  # what a web server answers for a missing page, never opened from disk
        for href in page.links:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or not parts.path:
                continue  # another site, or an anchor on this page
            target = (path.parent / unquote(parts.path)).resolve()
            # A directory would open as its listing, not as the page.
            assert target.is_file(), f"{path.relative_to(site)} links to {href}"
            checked += 1
    assert checked > 100
