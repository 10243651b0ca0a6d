"""The live dashboard on the shared `kvserve serve` process: /dashboard/state (taken on the engine thread) agrees
with /metrics and with the requests it runs, needs the API key (header or ?key=); the page itself, loaded in
headless Chromium while requests run, shows the same numbers as /metrics."""
from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from server_utils import API_KEY, MODEL, metric, wait_idle

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _state(server) -> dict:
    r = httpx.get(f"{server.url}/dashboard/state", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _long_requests(client, n: int = 3, max_tokens: int = 96) -> list[threading.Thread]:
    threads = [threading.Thread(target=client.completions.create, kwargs=dict(
        model=MODEL, prompt=f"Count slowly {i}:", max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True}))
        for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_the_state_shows_the_running_requests_and_agrees_with_metrics(server, client):
    assert httpx.get(f"{server.url}/dashboard/state", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/dashboard/state?key=wrong", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/dashboard/state?key={API_KEY}", timeout=30).status_code == 200
    page = httpx.get(f"{server.url}/dashboard?key={API_KEY}", timeout=30)
    assert page.status_code == 200 and "kvserve" in page.text and "dashboard/state" in page.text
    threads = _long_requests(client)
    try:
        for _ in range(200):
            state = _state(server)
            if state["counts"]["running"] == 3 and all(r["output_tokens"] > 0 for r in state["requests"]):
                break
        assert state["counts"]["running"] == 3 and len(state["requests"]) == 3
        held = [c for c in state["kv"]["cells"] if c >= 0]
        assert state["kv"]["used"] == len(held) == sum(r["blocks"] for r in state["requests"])
        assert state["counts"]["kv_usage"] == pytest.approx(len(held) / state["kv"]["num_blocks"], abs=2e-3)
    finally:
        for t in threads:
            t.join()
    wait_idle(server)
    time.sleep(0.6)   # past the age a snapshot is reused for
    state = _state(server)
    assert state["counts"]["generation_tokens"] == metric(server, "vllm:generation_tokens_total")
    assert state["counts"]["prompt_tokens"] == metric(server, "vllm:prompt_tokens_total")
    assert state["counts"]["running"] == 0 and state["kv"]["used"] == 0
    assert state["rates"]["itl_p50_ms"] is not None and state["rates"]["ttft_p50_ms"] is not None


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make setup installs it)")
def test_the_page_in_headless_chromium_shows_the_metrics(server, client):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(f"{server.url}/dashboard?key={API_KEY}")
        # the page polls already when the requests start: on a loaded machine they could end before it loaded
        page.wait_for_function("() => document.getElementById('running').textContent !== '-'", timeout=60000)
        threads = _long_requests(client, 2, max_tokens=256)   # seconds each: the page polls once a second
        page.wait_for_function("() => Number(document.getElementById('running').textContent) >= 1 && "
                               "document.querySelectorAll('tr.request').length >= 1", timeout=60000)
        for t in threads:
            t.join()
        wait_idle(server)
        want = str(int(metric(server, "vllm:generation_tokens_total")))
        page.wait_for_function(f"() => document.getElementById('generation-tokens').textContent === '{want}'",
                               timeout=30000)
        assert page.locator("#running").text_content() == "0"
        assert page.locator("#error").text_content() == ""
        browser.close()
