"""Headless Chromium for the dashboard's tests: the DOM after the page's scripts ran, and screenshots.

Each run gets a fresh profile in a temporary folder, its own session (process group), a time
limit, and is killed with all its children afterwards, so no browser outlives a test.
``--virtual-time-budget`` lets the page's timers run ahead of the wall clock: the page must not
poll faster than once a virtual second, which the tests check from the server's side.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio")


def find_browser() -> str | None:
    """The first Chromium or Chrome binary on PATH, or None."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def run(browser: str, url: str, args: list[str], timeout: float = 60.0) -> str:
    """Run the browser on ``url`` with ``args``; returns its stdout.

    Raises:
        AssertionError: it ran past ``timeout`` seconds or failed.
    """
    profile = tempfile.mkdtemp(prefix="lsgd-chromium-")
    cmd = [browser, *FLAGS, f"--user-data-dir={profile}", *args, url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc.pid)
        proc.communicate(timeout=10)
        raise AssertionError(f"{Path(browser).name} ran past {timeout} s on {url}") from None
    finally:
        _kill(proc.pid)  # helpers (zygote, renderer, GPU process) that outlived the main process
        shutil.rmtree(profile, ignore_errors=True)
    if proc.returncode != 0:
        raise AssertionError(f"{Path(browser).name} exited {proc.returncode}:\n{err[-3000:]}")
    return out


def _kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def dump_dom(browser: str, url: str, budget_ms: int = 5000, timeout: float = 60.0) -> "Dom":
    """The page's DOM after ``budget_ms`` of virtual time."""
    out = run(browser, url, [f"--virtual-time-budget={budget_ms}", "--window-size=1280,900",
                             "--dump-dom"], timeout)
    return Dom(out)


def screenshot(browser: str, url: str, png: Path, budget_ms: int = 5000,
               window: tuple[int, int] = (1280, 900), timeout: float = 60.0) -> Path:
    """Save a PNG of the page after ``budget_ms`` of virtual time."""
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    run(browser, url, [f"--virtual-time-budget={budget_ms}", f"--window-size={window[0]},{window[1]}",
                       f"--screenshot={png}"], timeout)
    if not png.exists() or png.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise AssertionError(f"no screenshot was written to {png}")
    return png


class Dom(HTMLParser):
    """The elements of a dumped page: tag, attributes and text, plus the text of each id."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
            "track", "wbr"}

    def __init__(self, html: str) -> None:
        super().__init__()
        self.html = html
        self.elements: list[dict] = []
        self.text: dict[str, str] = {}  # id -> text inside
        self._open: list[tuple[str, str | None]] = []  # (tag, id)
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.elements.append({"tag": tag, **a})
        if tag not in self.VOID:
            self._open.append((tag, a.get("id")))
            if a.get("id"):
                self.text.setdefault(a["id"], "")

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == tag:
                del self._open[i:]
                break

    def handle_data(self, data: str) -> None:
        for _, ident in self._open:
            if ident:
                self.text[ident] += data

    def find(self, **attrs: str) -> list[dict]:
        """Elements whose attributes include these (``data_node`` means ``data-node``)."""
        want = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [e for e in self.elements if all(e.get(k) == v for k, v in want.items())]

    def by_id(self, ident: str) -> dict:
        found = self.find(id=ident)
        if not found:
            raise AssertionError(f"no element with id {ident!r} in the page")
        return found[0]
