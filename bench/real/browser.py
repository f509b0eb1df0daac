"""Headless Chromium driven through chromedriver (Selenium), for the slot page's browser test and `bench.page`.

Debian's `chromium` and `chromium-driver` packages (`tools/test_services.sh` installs them): both paths are
given to Selenium, so its driver manager never tries to download a browser.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("CHROMIUM_BIN") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = os.environ.get("CHROMEDRIVER_BIN") or shutil.which("chromedriver") or "/usr/bin/chromedriver"


def available() -> str | None:
    """None when a test can drive the browser, else why not."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{Path(path).name} not installed (tools/test_services.sh installs it)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (make install)"
    return None


class Browser:
    """One headless Chromium; `open` loads a page and waits for its first render."""

    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        from selenium import webdriver

        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-extensions", "--no-first-run", f"--window-size={width},{height}"):
            opts.add_argument(arg)
        self.driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))

    def open(self, url: str, timeout: float = 10.0) -> None:
        self.driver.get(url)
        self.wait_renders(1, timeout)

    def renders(self) -> int:
        return int(self.driver.execute_script("return Number(document.body.dataset.renders || 0)"))

    def wait_renders(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.renders() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page rendered {self.renders()} time(s), not {n}, in {timeout} s")
            time.sleep(0.05)

    def dataset(self) -> dict[str, str]:
        return dict(self.driver.execute_script("return Object.assign({}, document.body.dataset)"))

    def js(self, script: str) -> Any:
        return self.driver.execute_script(script)

    def screenshot(self, path: Path) -> None:
        # The whole page, not just the window: resize to the document's height first.
        height = int(self.driver.execute_script("return document.documentElement.scrollHeight"))
        width = int(self.driver.execute_script("return window.innerWidth"))
        self.driver.set_window_size(width, min(max(height + 40, 400), 4000))
        self.driver.save_screenshot(str(path))

    def close(self) -> None:
        self.driver.quit()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# What the page shows, read back from its DOM: per server, per session, the data-v of every number cell.
READ_DOM = """
const out = {};
for (const sec of document.querySelectorAll("section[data-server]")) {
  const srv = {facts: {}, sessions: {}, slots: Number(sec.querySelector("svg.tl").dataset.slots),
               spans: sec.querySelectorAll("svg.tl rect").length,
               marks: Array.from(sec.querySelectorAll("svg.tl [data-mark]")).map((m) => m.dataset.mark)};
  for (const b of sec.querySelectorAll(".facts [data-f]")) srv.facts[b.dataset.f] = b.dataset.v;
  for (const tr of sec.querySelectorAll("tr[data-session]")) {
    const row = {};
    for (const td of tr.querySelectorAll("[data-f]")) row[td.dataset.f] = td.dataset.v;
    srv.sessions[tr.dataset.session] = row;
  }
  out[sec.dataset.server] = srv;
}
return out;
"""


def shown(browser: Browser) -> dict[str, Any]:
    return dict(browser.js(READ_DOM))
