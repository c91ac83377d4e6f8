"""Slow tier: the status page in a real browser (headless Debian chromium,
driven by Playwright) over a real local Ray cluster with an API key. The
page asks for the key, shows every worker with its blocks, its charts move
under load, the playground streams a reply token by token, and it keeps
working after a worker process is killed. A screenshot is saved under
$SHOAL_TEST_ARTIFACTS (default test-artifacts/)."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest
from serving import local_cluster_app
from test_failover_cluster import kill_process

pytestmark = pytest.mark.slow
APP = "shoal-page"
KEY = "sekret"


def _workers(base: str, n: int, timeout: float, gone: str | None = None) -> list[str]:
    """Wait until n workers answer (none of them `gone`), as /api/status lists them."""
    deadline, names = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            r = httpx.get(base + "/api/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
            names = [w["worker"] for w in r.json()["workers"]] if r.status_code == 200 else []
        except httpx.HTTPError:
            names = []
        if len(names) == n and gone not in names:
            return names
        time.sleep(0.5)
    raise AssertionError(f"{n} workers never answered (without {gone}): {names}")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("no chromium on PATH: `apt-get install chromium` (.ci/run installs it)")


def _load(base: str, n: int, stop: threading.Event) -> None:
    """n streams at a time, again and again, until stop."""

    def one():
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                c.post(
                    base + "/v1/completions",
                    headers={"Authorization": f"Bearer {KEY}"},
                    json={"prompt": "Continuous batching rebuilds", "max_tokens": 48, "ignore_eos": True},
                )

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _rows(page) -> dict[str, int]:
    """worker -> its KV blocks in total, as the page shows them."""
    return page.eval_on_selector_all(
        "tr.worker-row",
        "rs => Object.fromEntries(rs.map(r => [r.dataset.worker, +r.querySelector('.kv').dataset.total]))",
    )


def _play(page, prompt: str) -> tuple[str, int]:
    """Send from the playground; returns (reply, how many pieces the reply was built from).

    Counts the nodes the records add, not observer callbacks: a fast machine can deliver the whole stream in
    one network read, and the browser then batches every append into one callback."""
    page.evaluate("""() => { window.__grew = 0; const out = document.getElementById('play-output');
        new MutationObserver((records) => { for (const r of records) window.__grew += r.addedNodes.length; })
            .observe(out, {childList: true, characterData: true, subtree: true}); }""")
    page.fill("#play-input", prompt)
    page.fill("#play-max-tokens", "24")
    page.fill("#play-temperature", "0")
    page.click("#play-send")
    page.wait_for_function("document.getElementById('play-status').textContent.startsWith('done')", timeout=60_000)
    return page.inner_text("#play-output"), page.evaluate("window.__grew")


def test_status_page_in_a_real_browser(tiny_model):
    from playwright.sync_api import sync_playwright

    artifacts = os.environ.get("SHOAL_TEST_ARTIFACTS", "test-artifacts")
    os.makedirs(artifacts, exist_ok=True)
    # A host KV tier on each worker, so the tiers' panel has rows.
    options = dict(model=tiny_model, num_workers=2, num_threads=1, num_kv_blocks=256, kv_offload_host_bytes=1 << 20)
    with local_cluster_app(APP, api_key=KEY, **options) as (base, addr):
        _workers(base, 2, 120)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=_chromium(), headless=True, args=["--no-sandbox"])
            # Under the page's own CSP (no eval: only selectors here), it asks for the key and draws
            # every worker's KV bar with no violation reported to the console.
            strict = browser.new_page()
            violations: list[str] = []
            strict.on("console", lambda m: m.type == "error" and violations.append(m.text))
            strict.goto(base + "/")
            strict.wait_for_selector("#key-form", state="visible", timeout=30_000)
            strict.fill("#key-input", KEY)
            strict.press("#key-input", "Enter")
            strict.wait_for_selector("tr.worker-row .bar .used", state="attached", timeout=30_000)
            assert not violations, violations
            strict.close()
            # Playwright's wait_for_function evaluates strings, which the CSP (rightly) forbids.
            page = browser.new_page(viewport={"width": 1280, "height": 1100}, bypass_csp=True)
            errors: list[str] = []
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(base + "/")

            # The key: asked for, then sent with every request.
            page.wait_for_selector("#key-form", state="visible", timeout=30_000)
            page.fill("#key-input", KEY)
            page.press("#key-input", "Enter")
            page.wait_for_function("document.querySelectorAll('tr.worker-row').length === 2", timeout=30_000)
            rows = _rows(page)
            assert len(rows) == 2 and all(total == 256 for total in rows.values()), rows
            page.wait_for_function("document.querySelectorAll('tr.tier-row[data-tier=host]').length === 2")
            assert page.is_visible("#tiers-section")
            # Each tier row has what a block fetched from it costs beside what a prefill of one does.
            cells = "rows => rows.every(r => r.querySelector('td.fetch-ms') && r.querySelector('td.prefill-ms'))"
            assert page.eval_on_selector_all("tr.tier-row", cells)
            assert page.inner_text("#shape-workers") == "2/2" and "kv" in page.inner_text("#shape-routing")

            # Under load the charts take points and the token rate goes above zero.
            points = int(page.get_attribute("#chart-tps", "data-points") or 0)
            stop = threading.Event()
            threads = _load(base, 4, stop)
            try:
                page.wait_for_function(
                    f"+document.getElementById('chart-tps').dataset.points >= {points + 4}", timeout=60_000
                )
                page.wait_for_function("window.shoalStatus.series.tps.some(p => p[1] > 0)", timeout=60_000)
                page.wait_for_function("window.shoalStatus.series.p50.some(p => p[1] > 0)", timeout=60_000)
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=120)

            reply, grew = _play(page, "Hello there")
            assert reply and grew >= 2, (reply, grew)  # appended delta by delta, not set at once
            assert page.inner_text("#play-ttft").strip() not in ("", "–")
            page.screenshot(path=os.path.join(artifacts, "status_page.png"), full_page=True)

            # A worker's process dies: the page goes on, the replacement shows up, the playground still works.
            victim = sorted(rows)[0]
            kill_process(victim, APP)
            page.wait_for_function(
                f"![...document.querySelectorAll('tr.worker-row')].some(r => r.dataset.worker === {victim!r})",
                timeout=60_000,
            )
            _workers(base, 2, 180, gone=victim)
            page.wait_for_function("document.querySelectorAll('tr.worker-row').length === 2", timeout=60_000)
            assert victim not in _rows(page)
            reply, _ = _play(page, "Still there?")
            assert reply
            for _ in range(3):  # a few more polls drawn, so the screenshot shows the cluster after the kill
                seen = page.evaluate("window.shoalStatus.lastStatus()?.receivedAt ?? 0")
                page.wait_for_function(f"(window.shoalStatus.lastStatus()?.receivedAt ?? 0) > {seen}", timeout=30_000)
            page.screenshot(path=os.path.join(artifacts, "status_page_after_kill.png"), full_page=True)
            browser.close()
    assert not errors, errors  # the page asked for the key before sending anything that needs it
