"""`composer report` writes report.html: one self-contained page, opened here in real headless Chromium through
chromedriver (the W3C WebDriver protocol, spoken with urllib)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

from composer.runtime.processes import free_port
from tests.conftest import not_installed
from tests.unit.test_report import write_run
from tests.unit.test_run_status import make_run

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


class Browser:
    """One headless Chromium session behind chromedriver."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"
        options = {"binary": CHROMIUM, "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,900"]}
        capabilities = {"browserName": "chrome", "goog:chromeOptions": options, "goog:loggingPrefs": {"browser": "ALL"}}
        self.session = self.call("POST", "/session", {"capabilities": {"alwaysMatch": capabilities}})["sessionId"]

    def call(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["value"]

    def do(self, method: str, command: str, body: dict | None = None):
        return self.call(method, f"/session/{self.session}{command}", body)

    def close(self) -> None:
        self.do("DELETE", "")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip(not_installed("chromium chromium-driver"))
    port = free_port()
    driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and driver.poll() is None, "chromedriver did not start"
                time.sleep(0.2)
        session = Browser(port)
        try:
            yield session
        finally:
            session.close()
    finally:
        driver.terminate()
        driver.wait(timeout=30)


def test_report_html_is_self_contained_and_renders_every_plot(tmp_path, browser, composer):
    run = make_run(tmp_path / "runs", "mid-killed", "smoke-midtrain.yaml", 40, 0, checkpoints=[20])
    write_run(run)  # 40 steps of loss, lr, grad norm (one nan), throughput, MoE, eval, reward series
    result = composer("report", str(run))
    assert result.returncode == 0, result.stderr
    page = run / "report.html"
    text = page.read_text()
    assert not re.findall(r'(?:src|href)="(?!data:)', text)  # nothing outside the file: it opens offline
    assert "<script" not in text
    plots = sorted(p.stem for p in (run / "report").glob("*.png"))

    browser.do("POST", "/url", {"url": page.as_uri()})
    images = browser.do(
        "POST",
        "/execute/sync",
        {"script": "return [...document.images].map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight])", "args": []},
    )
    fetched = browser.do(
        "POST",
        "/execute/sync",
        {"script": "return performance.getEntriesByType('resource').map(e => e.name).filter(n => !n.startsWith('data:'))", "args": []},
    )
    body = browser.do("POST", "/execute/sync", {"script": "return document.body.innerText", "args": []})
    errors = [entry for entry in browser.do("POST", "/se/log", {"type": "browser"}) if entry["level"] in ("SEVERE", "ERROR")]
    screenshot = tmp_path / "report.png"
    screenshot.write_bytes(base64.b64decode(browser.do("GET", "/screenshot")))
    print(f"report.html screenshot: {screenshot}")

    assert errors == []
    assert sorted(alt for alt, *_ in images) == plots and len(plots) == 7
    assert all(complete and width > 600 and height > 300 for _, complete, width, height in images), images
    assert fetched == []
    assert "midtrain run, resumable; step 40 of 40; newest checkpoint step 20" in body
    assert "grad_norm" in body and "Resolved recipe" in body and "name: mid-killed" in body
    assert screenshot.stat().st_size > 10_000
    panels = browser.do(
        "POST",
        "/execute/sync",
        {
            "script": "return [...document.querySelectorAll('section')].map(s => [s.querySelector('h2').innerText, [...s.querySelectorAll('img')].map(i => i.alt)])",
            "args": [],
        },
    )
    assert [title for title, _ in panels][:2] == ["Reward and held-out evaluation", "Loss and optimizer"]  # headline first
    assert sorted(alt for _, alts in panels for alt in alts) == plots


def test_report_compare_shows_both_runs_in_one_page(tmp_path, browser, composer):
    for name in ("first", "second"):
        write_run(tmp_path / "runs" / name)
    result = composer("report", "--compare", str(tmp_path / "runs" / "first"), str(tmp_path / "runs" / "second"))
    assert result.returncode == 0, result.stderr
    page = tmp_path / "runs" / "compare-first-second" / "report.html"
    browser.do("POST", "/url", {"url": page.as_uri()})
    images = browser.do(
        "POST", "/execute/sync", {"script": "return [...document.images].map(i => [i.alt, i.complete, i.naturalWidth])", "args": []}
    )
    body = browser.do("POST", "/execute/sync", {"script": "return document.body.innerText", "args": []})
    assert len(images) == 7 and all(complete and width > 600 for _, complete, width in images)
    assert "first" in body and "second" in body and "Reward and held-out evaluation" in body
    single = composer("report", str(tmp_path / "runs" / "first"), str(tmp_path / "runs" / "second"))
    assert single.returncode == 2 and "pass --compare" in single.stderr
