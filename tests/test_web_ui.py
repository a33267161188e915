"""The built-in web page in a real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by Selenium)
against a real server on the embedded model with --api-key: open /, give the key, send a message and watch the
answer stream in, press Stop mid-stream (the server aborts the request), see the dashboard update; the page at a
phone's size. Screenshots are saved under the test's output folder (and $RADIXSERVE_SCREENSHOT_DIR if set)."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from server_utils import serving

API_KEY = "sk-web-ui"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _need_browser() -> None:
    missing = [n for n, v in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if v is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium")
    if missing:
        msg = f"web UI test needs {', '.join(missing)} (.ci/run installs them)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def test_page_routes_follow_flags() -> None:
    """In-process: the page is public (the API behind it is not), --disable-web-ui removes it, /stats stays."""
    from fastapi.testclient import TestClient

    from radixserve.entrypoints.http_server import create_app
    from radixserve.server_args import ServerArgs

    def app(**kw: Any) -> TestClient:
        tm = SimpleNamespace(tokenizer=None, rid_to_state={}, metrics=None, context_len=2048)
        procs = SimpleNamespace(alive=lambda: False)
        return TestClient(create_app(tm, procs, ServerArgs(api_key=API_KEY, **kw)))

    c = app()
    page = c.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/static/app.js" in page.text
    # nothing is loaded from another origin (works offline)
    for name in ("index.html", "app.js", "app.css"):
        body = c.get(f"/static/{name}").text
        assert c.get(f"/static/{name}").status_code == 200
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", body) and "@import" not in body
    assert c.get("/static/..%2F..%2Fserver_args.py").status_code in (401, 404)  # never a file outside static/
    assert c.get("/static/nope.js").status_code == 404
    assert c.get("/stats").status_code == 401 and c.get("/v1/models").status_code == 401
    stats = c.get("/stats", headers=AUTH).json()
    assert stats["engine_alive"] is False and stats["num_running_reqs"] == 0 and stats["gen_throughput"] == 0
    off = app(disable_web_ui=True)
    assert off.get("/").status_code == 401 and off.get("/static/app.js").status_code == 401  # nothing public
    assert off.get("/", headers=AUTH).status_code == 404 and off.get("/static/app.js", headers=AUTH).status_code == 404
    assert off.get("/stats", headers=AUTH).status_code == 200


@pytest.fixture(scope="module")
def server(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _need_browser()
    args = ["--max-total-tokens", "4096", "--api-key", API_KEY]
    with serving(str(tmp_path_factory.mktemp("web") / "server.log"), args) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(what: str, cond: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _screenshot(driver: Any, tmp_path: Any, name: str) -> None:
    path = tmp_path / name
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 1000
    extra = os.environ.get("RADIXSERVE_SCREENSHOT_DIR")
    if extra:
        os.makedirs(extra, exist_ok=True)
        shutil.copy(path, os.path.join(extra, name))


def _inflight(base: str) -> int:
    return httpx.get(base + "/get_internal_state", headers=AUTH, timeout=30).json()["num_inflight_requests"]


@pytest.mark.integration
def test_chat_stream_stop_and_dashboard(server: str, browser: Any, tmp_path: Any) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    d.get(server + "/")
    by_id = lambda i: d.find_element(By.ID, i)  # noqa: E731
    # the API answers 401 without the key: the page asks for it
    _wait("the API-key banner", lambda: by_id("auth").is_displayed())
    by_id("api-key").send_keys(API_KEY)
    by_id("save-key").click()
    _wait("the model name", lambda: by_id("model-name").text == "SmolLM2-135M-Instruct")

    # a long answer, streamed: its text grows while the request runs; Stop aborts it on the server
    for field, value in (("temperature", "0"), ("max-tokens", "400")):
        by_id(field).clear()
        by_id(field).send_keys(value)
    by_id("prompt").send_keys("Count from 1 to 300, separated by commas.")
    by_id("send").click()
    answer = lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .text")[-1].text  # noqa: E731
    first = _wait("the first streamed text", lambda: answer(), timeout=120)
    _wait("more streamed text", lambda: len(answer()) > len(first) + 5)
    assert d.find_elements(By.CSS_SELECTOR, ".msg.assistant.streaming") and _inflight(server) == 1
    by_id("stop").click()
    last = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    _wait("the stopped mark", lambda: last.get_attribute("data-done") == "stopped", timeout=10)
    assert by_id("chat-status").text == "Stopped." and by_id("send").is_enabled()
    _wait("the server to abort the request", lambda: _inflight(server) == 0, timeout=15)
    stopped_text = answer()
    time.sleep(1.0)
    assert answer() == stopped_text  # nothing arrives after Stop

    # a short answer runs to its end (the history is sent along)
    by_id("max-tokens").clear()
    by_id("max-tokens").send_keys("12")
    by_id("prompt").send_keys("Now say hello.")
    by_id("send").click()
    last = _wait("a second answer", lambda: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2 and
                 d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1])
    _wait("the second answer to finish", lambda: last.get_attribute("data-done") in ("stop", "length"))
    assert "tokens" in last.find_element(By.CLASS_NAME, "meta").text and answer()
    _screenshot(d, tmp_path, "web_ui_chat.png")

    # the dashboard polls /stats: it updates, and shows the finished request and its TTFT
    by_id("tab-dash").click()
    view = by_id("view-dash")
    seen = int(view.get_attribute("data-updates") or 0)
    _wait("two dashboard updates", lambda: int(view.get_attribute("data-updates") or 0) >= seen + 2, timeout=15)
    assert int(by_id("s-done").text) >= 1
    assert by_id("s-ttft").text.endswith(" ms") and by_id("s-kv").text.endswith(" %")
    assert by_id("s-running").text == "0" and "KV tokens held" in by_id("dash-status").text
    _screenshot(d, tmp_path, "web_ui_dashboard.png")

    # a phone-sized screen: nothing wider than the screen, the composer reachable
    d.set_window_size(390, 844)
    by_id("tab-chat").click()
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    assert by_id("prompt").is_displayed() and by_id("send").is_displayed()
    _screenshot(d, tmp_path, "web_ui_phone.png")
    d.set_window_size(1280, 860)
