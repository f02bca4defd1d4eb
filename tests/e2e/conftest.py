"""Fixtures of the end-to-end tests: a real headless browser (Debian's chromium driven by Playwright)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def _install_chromium() -> str | None:
    """Install Debian's chromium with apt; None on success, else why it could not be installed."""
    apt = shutil.which("apt-get")
    if apt is None:
        return "apt-get is not available (not a Debian/Ubuntu machine)"
    prefix: list[str] = []
    if os.geteuid() != 0:
        sudo = shutil.which("sudo")
        if sudo is None or subprocess.run([sudo, "-n", "true"], capture_output=True).returncode != 0:
            return "not root and no password-less sudo to run apt-get"
        prefix = [sudo, "-n"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["update"], ["install", "-y", "--no-install-recommends", "chromium"]):
        result = subprocess.run([*prefix, apt, *command], env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            return f"apt-get {' '.join(command)} failed: {result.stderr.strip()[-300:]}"
    return None if CHROMIUM.exists() else "apt-get installed no /usr/bin/chromium"


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """A headless chromium page factory (Playwright's own browser download is never used)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: it is a test dependency in requirements-dev.lock; run `make setup-dev`")
    if not CHROMIUM.exists():
        why = _install_chromium()
        if why is not None:
            pytest.skip(f"Debian's chromium could not be installed ({why}); the report was not opened in a browser")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser: object, page_path: Path) -> dict:
    """Load a local HTML file and report what a person would see: each image's load state, the tables
    and the section texts. Only file:// requests are allowed (the report must need no server)."""
    page = browser.new_page()
    remote: list[str] = []

    def route(route_obj) -> None:
        if route_obj.request.url.startswith("file://"):
            route_obj.continue_()
        else:
            remote.append(route_obj.request.url)
            route_obj.abort()

    page.route("**/*", route)
    page.goto(page_path.resolve().as_uri(), wait_until="load")
    images = page.eval_on_selector_all(
        "img", "els => els.map(e => ({src: e.getAttribute('src'), complete: e.complete, width: e.naturalWidth}))")
    tables = page.eval_on_selector_all(
        "table", "els => els.map(t => ({cls: t.className, rows: t.querySelectorAll('tbody tr').length}))")
    sections = page.eval_on_selector_all("section", "els => Object.fromEntries(els.map(s => [s.id, s.innerText]))")
    page.close()
    return {"images": images, "tables": tables, "sections": sections, "remote": remote}
