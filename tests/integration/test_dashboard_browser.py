"""`/dashboard` in real headless Chromium (Debian's package, driven by Playwright) against the
running API, a worker per version and real traffic: the charts draw data, a screenshot is kept as
a test artefact, and the page's JavaScript logs no error. Also the endpoints it reads: an admin
key for the queue, the audit log and the rollout, the series' bounds, the shell's CSP."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from playwright.sync_api import ConsoleMessage, Error, Page, sync_playwright

from launch.seed import Seeded
from sluice.registry import catalog
from sluice.registry.store import Registry
from sluice.settings import Settings
from tests.integration.test_openapi import conforms
from tests.support import REPO, ApiServer, serving

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
# No sandbox: CI runs as root. The rest keeps a closed-network run from trying to phone home.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
STEP_S = 5  # the page's default window (5 min) draws buckets of 5 s

# True once the version's panel has drawn lines with points for both latencies and the rate, and
# bars for its batch sizes.
DRAWN = """([version, least]) => {
  const panel = document.querySelector(`section.version[data-version="${version}"]`);
  if (!panel) return false;
  const points = (chart, series) => Number(panel.querySelector(
    `svg[data-chart="${chart}"] path[data-series="${series}"]`)?.getAttribute("data-points") || 0);
  const bars = [...panel.querySelectorAll('svg[data-chart="batch_sizes"] rect.bar')];
  return points("queue_wait", "p50") >= least && points("model_time", "p50") >= least
    && points("throughput", "rate") >= least && bars.some((bar) => Number(bar.dataset.value) > 0);
}"""


def artefacts() -> Path:
    folder = Path(os.environ.get("SLUICE_TEST_ARTIFACTS") or REPO / "tests" / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def spec(anon: httpx.Client) -> dict[str, Any]:
    body: dict[str, Any] = anon.get("/openapi.json").json()
    return body


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"Debian's chromium is missing at {CHROMIUM}: the dashboard's browser test needs it "
                    "(apt-get install -y chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser: Any, url: str, errors: list[str]) -> Page:
    page: Page = browser.new_context(viewport={"width": 1440, "height": 1000}).new_page()

    def on_console(message: ConsoleMessage) -> None:
        if message.type in ("error", "assert"):
            errors.append(f"console.{message.type}: {message.text} ({message.location})")

    page.on("console", on_console)
    page.on("pageerror", lambda error: errors.append(f"pageerror: {error}"))
    page.goto(url)
    return page


def sign_in(page: Page, key: str) -> None:
    page.wait_for_selector("#key-input", state="visible")
    page.fill("#key-input", key)
    page.click("#key-form button[type=submit]")


def test_the_shell_is_served_without_a_key_under_a_strict_csp(anon: httpx.Client) -> None:
    page = anon.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "<script>" not in page.text and 'src="/dashboard/static/dashboard.js"' in page.text
    assert page.headers["etag"] and anon.get("/dashboard", headers={"If-None-Match": page.headers["etag"]}
                                             ).status_code == 304
    script = anon.get("/dashboard/static/dashboard.js")
    assert script.status_code == 200 and script.headers["content-type"] == "text/javascript; charset=utf-8"
    assert "innerHTML" not in script.text, "data goes into the page as text, never as markup"
    style = anon.get("/dashboard/static/dashboard.css")
    assert style.status_code == 200 and style.headers["content-type"] == "text/css; charset=utf-8"
    for name in ("dashboard.html", "..%2Fapp.py", "nope.js"):
        assert anon.get(f"/dashboard/static/{name}").status_code == 404
    assert "/dashboard" not in anon.get("/openapi.json").json()["paths"]


def test_the_data_endpoints_want_an_admin_key(
    anon: httpx.Client, demo: httpx.Client, admin: httpx.Client, register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("dash-auth")
    # Each version's stats and series count every tenant's jobs: operator views, like the queue.
    answered = [f"/v1/models/{model}/queue", f"/v1/models/{model}/versions/v1/stats",
                f"/v1/models/{model}/versions/v1/stats/series"]
    admin_only = [*answered, f"/v1/models/{model}/audit", f"/v1/models/{model}/rollouts",
                  f"/v1/models/{model}/rollouts/current"]
    every = [*admin_only, "/v1/models"]
    for path in every:
        response = anon.get(path)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "unauthenticated"
    for path in admin_only:
        response = demo.get(path)
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["code"] == "forbidden"
    for path in answered:
        assert admin.get(path).status_code == 200, path
    series = f"/v1/models/{model}/versions/v1/stats/series"
    for params in ({"window_s": 10, "step_s": 20}, {"window_s": 86_400, "step_s": 1}, {"step_s": 0},
                   {"window_s": 0}, {"window_s": "x"}, {"step_s": 7200}):
        response = admin.get(series, params=params)
        assert response.status_code == 422, (params, response.text)
    assert admin.get(f"/v1/models/{model}/versions/v9/stats/series").status_code == 404
    assert admin.get("/v1/models/no-such-model/queue").status_code == 404


def submit_traffic(demo: httpx.Client, model: str, *, rounds: int, per_round: int, every_s: float) -> list[str]:
    """Open-loop: `per_round` jobs at each tick of a fixed timetable, spread over both versions by
    routing key; one in 40 is an input the synthetic model refuses (errors on the chart)."""
    ids = []
    start = time.monotonic()
    for tick in range(rounds):
        time.sleep(max(0.0, start + tick * every_s - time.monotonic()))
        for i in range(per_round):
            n = tick * per_round + i
            text = "__poison__" if n % 40 == 7 else f"hello dashboard {n}"
            response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": text}, "routing_key": f"k{n}"})
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
    return ids


@pytest.mark.soak
def test_the_dashboard_draws_each_version_of_a_model_under_traffic(
    chromium: Any, api: ApiServer, settings: Settings, seeded: Seeded, admin: httpx.Client, demo: httpx.Client,
    spec: dict[str, Any],
    register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., list[dict[str, Any]]], capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None], registry: Registry,
) -> None:
    model = register_synthetic("dash", versions=("v1", "v2"), max_wait_ms=20.0)
    start_worker(model, "v1")
    start_worker(model, "v2")
    # A canary at 10 %: an audit row (the weights), a rollout and its start decision to show.
    started = admin.post(f"/v1/models/{model}/rollouts", json={
        "canary": "v2", "steps": [10, 50, 100], "soak_s": 3600, "reason": "dashboard <b>test</b>"})
    assert started.status_code == 201, started.text

    ids = submit_traffic(demo, model, rounds=26, per_round=24, every_s=0.5)
    jobs = wait_jobs(demo, ids)
    by_version = {v: [j for j in jobs if j["version"] == v] for v in ("v1", "v2")}
    assert len(by_version["v1"]) > 400 and len(by_version["v2"]) > 20, {v: len(j) for v, j in by_version.items()}
    assert {j["status"] for j in jobs} == {"succeeded", "failed"}

    # Let the last bucket of the traffic complete, then check the endpoints the page reads.
    time.sleep(max(0.0, (int(time.time() / STEP_S) + 1) * STEP_S - time.time() + 0.2))
    series = admin.get(f"/v1/models/{model}/versions/v1/stats/series", params={"window_s": 300, "step_s": STEP_S})
    assert series.status_code == 200, series.text
    conforms(spec, "StatsSeriesResource", series.json())
    full = [b for b in series.json()["buckets"] if b["count"]]
    assert len(full) >= 3 and sum(b["count"] for b in full) == len(by_version["v1"])
    assert any(b["queue_wait_ms"]["p99"] is not None for b in full) and any(b["errors"] for b in full)
    queue = admin.get(f"/v1/models/{model}/queue")
    conforms(spec, "QueueResource", queue.json())
    assert {v["version"]: (v["live_workers"], v["lanes"]["online"]["lag"]) for v in queue.json()["versions"]} == {
        "v1": (1, 0), "v2": (1, 0)}

    stats = admin.get(f"/v1/models/{model}/versions/v1/stats")
    conforms(spec, "StatsResource", stats.json())
    cost = stats.json()["cost"]
    # The synthetic model has no tokenizer: its passes count the batcher's costs, padded.
    assert cost["real_tokens"] > 0 and cost["padding_ratio"] >= 1.0 and cost["core_s"] > 0
    assert cost["per_1k_jobs"] is None, "no price is configured on the session's API"
    assert stats.json()["fill_ms"]["p50"] is not None

    # v2's batching was tuned (as the nightly job dates it) and has a proposal waiting; v1's never.
    with registry.session() as session:
        row = catalog.get_version(session, model, "v2")
        row.tuned_at = datetime(2026, 12, 3, 3, 0, tzinfo=UTC)
        row.tune_proposal = {"max_batch_size": 8, "max_wait_ms": 5.0, "throughput_rps": 112.0, "p99_ms": 240.0,
                             "p99_budget_ms": 300.0, "current_rps": 100.0, "gain": 0.12,
                             "planned_at": datetime(2026, 12, 3, 3, 0, tzinfo=UTC).timestamp(), "on": {}}
    # The page is read from an API that knows a price per core-hour.
    priced = settings.model_copy(update={"price_per_core_hour": 0.05})
    errors: list[str] = []
    with serving(priced) as priced_api:
        page = open_page(chromium, f"{priced_api.url}/dashboard#model={model}", errors)
        sign_in(page, seeded.admin_key)
        for version in ("v1", "v2"):
            page.wait_for_function(DRAWN, arg=[version, 2], timeout=30_000)
        check_the_page(page, errors, capsys, record_property)
        page.context.close()  # before its API stops: a poll after that would log a failed load

    # The session's API has no price: the cost is unknown, not free.
    page = open_page(chromium, f"{api.url}/dashboard#model={model}", errors)
    sign_in(page, seeded.admin_key)
    page.wait_for_function(DRAWN, arg=["v1", 2], timeout=30_000)
    v1 = page.locator('section.version[data-version="v1"]')
    assert v1.locator('[data-tile="cost"] .tile-value').text_content() == "—", "no price, no cost"
    # A model that never had a rollout: none is shown, and nothing fails to load on the way.
    quiet = register_synthetic("dash-quiet")
    assert admin.get(f"/v1/models/{quiet}/rollouts").json() == {"items": []}
    page.evaluate("name => { location.hash = 'model=' + encodeURIComponent(name); }", quiet)
    page.wait_for_selector(f'div.model[data-model="{quiet}"] section.version[data-version="v1"]', timeout=15_000)
    page.wait_for_timeout(3500)
    assert page.locator("table.decisions tbody tr").count() == 0
    assert not errors, errors


def check_the_page(page: Page, errors: list[str], capsys: pytest.CaptureFixture[str],
                   record_property: Callable[[str, object], None]) -> None:
    # The sparklines gather one point per poll: wait for a second poll.
    page.wait_for_function("""() => Number(document.querySelector(
        'section.version[data-version="v1"] [data-tile="lag-online"] svg.spark')?.dataset.points || 0) >= 2""",
                           timeout=15_000)

    v1 = page.locator('section.version[data-version="v1"]')
    for chart in ("queue_wait", "model_time"):
        path = v1.locator(f'svg[data-chart="{chart}"] path[data-series="p50"]')
        assert (path.get_attribute("d") or "").startswith("M") and "L" in (path.get_attribute("d") or "")
    assert int(v1.locator('svg[data-chart="queue_wait"] path[data-series="p99"]').get_attribute("data-points")
               or 0) >= 1
    assert int(v1.locator('svg[data-chart="error_rate"] path[data-series="errors"]').get_attribute("data-points")
               or 0) >= 3
    sizes = [int(v or 0) for v in v1.locator('svg[data-chart="batch_sizes"] rect.bar').evaluate_all(
        "bars => bars.map(b => b.dataset.value)")]
    assert sum(sizes) > 0
    reasons = dict(v1.locator('svg[data-chart="close_reasons"] rect.bar').evaluate_all(
        "bars => bars.map(b => [b.dataset.label, Number(b.dataset.value)])"))
    assert set(reasons) == {"size", "age", "drain"} and sum(reasons.values()) > 0
    assert v1.locator('[data-tile="lag-online"] .tile-value').text_content() == "0"
    assert v1.locator('[data-tile="live"] .tile-value').text_content() == "1"
    # Cost per 1,000 jobs per version, at the priced API's price per core-hour; and the last tuning
    # (the version JSON's `batching.tuned_at`) with its date, or never.
    for version in ("v1", "v2"):
        panel = page.locator(f'section.version[data-version="{version}"]')
        cost = panel.locator('[data-tile="cost"] .tile-value').text_content() or ""
        assert float(cost) > 0, (version, cost)
        assert (panel.locator('[data-tile="padding"] .tile-value').text_content() or "").endswith("×")
    tuned = page.locator('section.version[data-version="v2"] [data-field="tuned_at"]').text_content() or ""
    assert tuned.startswith("last tuned 2026-12-0"), tuned  # the date, in the browser's time zone
    never = page.locator('section.version[data-version="v1"] [data-field="tuned_at"]').text_content()
    assert never == "last tuned never"
    offered = page.locator('section.version[data-version="v2"] [data-field="proposal"]').text_content() or ""
    assert offered.startswith("proposal: up to 8, 5 ms, +12"), offered
    assert page.locator('section.version[data-version="v1"] [data-field="proposal"]').text_content() == ""

    weights = page.locator("table.weights")
    assert weights.locator('tr[data-version="v1"] td.weight').text_content() == "90"
    assert weights.locator('tr[data-version="v2"] td.weight').text_content() == "10"
    assert page.locator("table.decisions tbody tr[data-action='start']").count() == 1
    rollout = page.locator(".rollout").text_content() or ""
    assert "canary v2 against stable v1" in rollout and "running" in rollout
    assert "<b>test</b>" in (page.locator("table.audit").text_content() or ""), "a reason shows as text"
    assert page.locator("table.audit tbody tr").count() >= 2
    assert page.locator(".rollout b, table.audit b").count() == 0, "a reason's markup never becomes elements"

    shot = artefacts() / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    record_property("screenshot", str(shot))
    with capsys.disabled():
        sys.stdout.write(f"\ndashboard screenshot: {shot}\n")

    # A tooltip on hover, and the page still polls cleanly afterwards.
    v1.locator('svg[data-chart="queue_wait"] rect.zone').hover()
    tip = v1.locator('figure[data-figure="queue_wait"] .tip')
    tip.wait_for(state="visible", timeout=5_000)
    assert "jobs" in (tip.text_content() or "") and "p50" in (tip.text_content() or "")
    page.mouse.move(0, 0)
    page.wait_for_timeout(3500)
    assert not errors, errors


def test_a_key_that_is_not_an_admin_key_gets_a_clear_message(
    chromium: Any, api: ApiServer, seeded: Seeded,
) -> None:
    errors: list[str] = []
    page = open_page(chromium, f"{api.url}/dashboard", errors)
    sign_in(page, seeded.demo_key)
    message = page.locator("#key-message")
    message.wait_for(state="visible", timeout=15_000)
    assert "not an admin key (403" in (message.text_content() or "")
    assert page.evaluate("sessionStorage.length") == 0, "a refused key is not kept"
    sign_in(page, "sk_not_a_key_at_all")
    page.wait_for_function("() => document.querySelector('#key-message').textContent.includes('401')",
                           timeout=15_000)
    # The refused calls show as failed loads in the console; the script itself throws nothing.
    assert not [e for e in errors if e.startswith("pageerror")], errors
    assert all("Failed to load resource" in e for e in errors), errors
    with pytest.raises(Error):
        page.wait_for_selector("section.version", timeout=1_000)


def test_an_admin_key_in_the_address_fragment_opens_the_dashboard_without_typing(
    chromium: Any, api: ApiServer, seeded: Seeded, register_synthetic: Callable[..., str],
) -> None:
    """How an automated browser signs in: `#key=…` never reaches the server, and the page takes
    it out of the address (the bar and the history) as soon as it has read it."""
    model = register_synthetic("dash-fragment")
    errors: list[str] = []
    page = open_page(chromium, f"{api.url}/dashboard#key={quote(seeded.admin_key)}&model={model}", errors)
    page.wait_for_selector(f'div.model[data-model="{model}"] section.version[data-version="v1"]', timeout=15_000)
    assert page.locator("#login").is_hidden()
    assert page.locator('table.weights tr[data-version="v1"] td.weight').text_content() == "100"
    assert page.evaluate("location.hash") == f"#model={model}", "the key is gone from the address"
    assert seeded.admin_key not in page.evaluate("location.href")
    assert page.evaluate("sessionStorage.getItem('sluice.dashboard.key')") == seeded.admin_key
    page.wait_for_timeout(3500)  # a second poll with the stored key
    assert page.locator("section.version").count() == 1
    assert not errors, errors
