"""The browser pages, in a real browser: ``/dashboard``, ``/web`` and the bench's ``report.html``.

Headless Chromium (Debian's ``chromium`` package) driven by Playwright; both are installed by
``make test`` (``scripts/install-browser-deps.sh`` and the ``dev`` extra). Without them the
tests skip with the reason (a non-root dev machine). The browser is launched once per module;
every page is checked for what a person would see, and for fetching nothing from another
origin (the pages must work where no CDN is reachable).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import pytest_asyncio

import stadium
from stadium import AsyncClient
from stadium.bench import report
from stadium.bench.results import PointKey, PointSettings, SessionResult, summarize
from tests.conftest import TRANSPORTS, UNIT, serve

CHROMIUM = os.environ.get("STADIUM_CHROMIUM", "/usr/bin/chromium")
try:
    from playwright.async_api import Browser, Page, Route, async_playwright
except ImportError:  # pragma: no cover - depends on the machine
    async_playwright = None

_MISSING = (
    "playwright is not installed (pip install -e '.[dev]')"
    if async_playwright is None
    else f"no Chromium at {CHROMIUM} (apt-get install chromium; make test installs it as root)"
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM))
    else None
)
_MUST_RUN = os.geteuid() == 0 and shutil.which("apt-get") is not None
"""As root with apt-get (CI, ``make test``), the browser is installed: its absence is a failure."""
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_MISSING is not None and not _MUST_RUN, reason=str(_MISSING)),
    pytest.mark.asyncio(loop_scope="module"),
]
MS = 1000 * UNIT
"""Playwright's timeouts are in milliseconds."""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def browser() -> AsyncIterator[Browser]:
    if _MISSING is not None:
        pytest.fail(f"{_MISSING}; run `make browser-deps` (root) or `make test`")
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        try:
            yield b
        finally:
            await b.close()


class Tab:
    """A fresh page that records (and aborts) every request to a non-local origin, and
    answers the paths in :attr:`fakes` itself."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.external: list[str] = []
        self.errors: list[str] = []
        self.fakes: dict[str, Any] = {}
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    async def route(self, route: Route) -> None:
        url = urlsplit(route.request.url)
        if url.scheme not in ("data", "file") and url.hostname not in ("127.0.0.1", "localhost"):
            self.external.append(route.request.url)
            await route.abort()
        elif url.path in self.fakes:
            await route.fulfill(status=200, body=self.fakes[url.path](), content_type="text/plain")
        else:
            await route.continue_()


@pytest_asyncio.fixture(loop_scope="module")
async def tab(browser: Browser) -> AsyncIterator[Tab]:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    page = await context.new_page()
    page.set_default_timeout(10 * MS)
    t = Tab(page)
    await page.route("**/*", t.route)
    try:
        yield t
    finally:
        await context.close()
    assert t.external == [], "the page fetched from another origin"
    assert t.errors == [], "the page raised"


async def text(page: Page, selector: str) -> str:
    return (await page.locator(selector).inner_text()).strip()


async def wait_text(page: Page, selector: str, predicate: str) -> None:
    """Wait until ``predicate`` (JS, over ``t``: the element's text) holds."""
    await page.wait_for_function(
        f"() => {{ const e = document.querySelector({selector!r}); "
        f"if (!e) return false; const t = e.textContent.trim(); return {predicate}; }}"
    )


# ------------------------------------------------------------------- dashboard


def _fake_metrics() -> Any:
    """Prometheus text whose counters grow by 100 steps (and a fixed latency mix) per scrape."""
    k = 0

    def scrape() -> str:
        nonlocal k
        k += 1
        lines = [
            "# HELP stadium_sessions_active Sessions open now.",
            "# TYPE stadium_sessions_active gauge",
            f'stadium_sessions_active{{worker="0"}} {3 + k % 2}',
            f'stadium_sessions_active{{worker="1"}} {4}',
            "# TYPE stadium_admission_queue gauge",
            "stadium_admission_queue 1",
            "# TYPE stadium_sessions_total counter",
            f'stadium_sessions_total{{outcome="completed"}} {10 * k}',
            'stadium_sessions_total{outcome="refused"} 2',
            "# TYPE stadium_steps_total counter",
            f"stadium_steps_total {100 * k}",
            "# TYPE stadium_errors_total counter",
            f'stadium_errors_total{{code="TIMEOUT"}} {2 * k}',
            'stadium_errors_total{code="VALIDATION_ERROR"} 0',
            "# TYPE stadium_step_duration_seconds histogram",
            f'stadium_step_duration_seconds_bucket{{le="0.001"}} {50 * k}',
            f'stadium_step_duration_seconds_bucket{{le="0.005"}} {90 * k}',
            f'stadium_step_duration_seconds_bucket{{le="0.01"}} {100 * k}',
            f'stadium_step_duration_seconds_bucket{{le="+Inf"}} {100 * k}',
            f"stadium_step_duration_seconds_sum {0.2 * k}",
            f"stadium_step_duration_seconds_count {100 * k}",
        ]
        for w in ("0", "1"):
            lines += [
                f'stadium_worker_resident_memory_bytes{{worker="{w}"}} {100 * 1048576}',
                f'stadium_worker_cpu_seconds_total{{worker="{w}"}} {0.1 * k}',
                f'stadium_worker_open_connections{{worker="{w}"}} 3',
                f'stadium_bytes_received_total{{worker="{w}"}} {1024 * k}',
                f'stadium_bytes_sent_total{{worker="{w}"}} {2048 * k}',
            ]
        return "\n".join(lines) + "\n"

    return scrape


async def test_dashboard_parses_metrics_and_draws(tab: Tab) -> None:
    """Against a scripted ``/metrics``: the tiles, percentiles (from bucket deltas), charts,
    error and per-worker tables show what the Prometheus text says."""
    page = tab.page
    tab.fakes["/metrics"] = _fake_metrics()
    async with serve("echo") as server:
        await page.goto(server.url + "/dashboard?every=0.2")
        await wait_text(page, "#steps-total", "Number(t.replace(/,/g, '')) >= 300")
        first = await text(page, "#steps-total")
        await wait_text(page, "#steps-total", f"t !== {first!r}")
        assert await text(page, "#sessions-active") in ("7", "8")
        assert await text(page, "#admission-queue") == "1"
        assert await text(page, "#step-p50") == "1.00"  # 50 of 100 under 1 ms
        assert await text(page, "#step-p99") == "9.50"  # rank 99 in (5 ms, 10 ms]
        assert await text(page, "#env-name") != ""
        errors = await page.locator("#errors tbody tr").all_inner_texts()
        assert len(errors) == 1  # zero counts hidden
        assert errors[0].startswith("TIMEOUT")
        workers = await page.locator("#workers tbody tr").all_inner_texts()
        assert [w.split("\t")[0] for w in workers] == ["0", "1"]
        assert "100.0" in workers[0]  # RSS MiB
        outcomes = await page.locator("#outcomes tbody tr").all_inner_texts()
        assert {o.split("\t")[0] for o in outcomes} == {"completed", "refused"}
        for chart in ("sessions", "throughput", "latency", "errors"):
            points = await page.get_attribute(f"#chart-{chart} polyline", "points")
            assert points is not None, chart
            assert len(points.split()) >= 2, chart


async def test_dashboard_moves_while_sessions_run(tab: Tab) -> None:
    """Against the server's own ``/metrics``: steps total and the sessions chart move while a
    client runs sessions."""
    async with serve("benchmark") as server:
        async with httpx.AsyncClient() as http:
            if (await http.get(server.url + "/metrics")).status_code != 200:
                pytest.skip("GET /metrics is not in this tree yet")
        page = tab.page
        await page.goto(server.url + "/dashboard?every=0.2")
        await wait_text(page, "#steps-total", "t !== '–'")

        async def run() -> None:
            while True:
                async with AsyncClient(server.url) as env:
                    await env.reset()
                    for _ in range(20):
                        await env.step({"wait_seconds": 0.0})
                    await asyncio.sleep(0.02)

        driver = asyncio.ensure_future(run())
        try:
            await wait_text(page, "#steps-total", "Number(t.replace(/,/g, '')) >= 20")
            before = await text(page, "#steps-total")
            await wait_text(page, "#steps-total", f"t !== {before!r}")
            await wait_text(page, "#steps-rate", "Number(t.replace(/,/g, '')) > 0")
            await page.wait_for_function(
                "() => (document.querySelector('#chart-sessions polyline')"
                "?.getAttribute('points') || '').trim().split(/\\s+/).length >= 2"
            )
        finally:
            driver.cancel()
            with pytest.raises(asyncio.CancelledError):
                await driver


async def test_dashboard_shows_each_tenant_with_tenants_on(tab: Tab, tmp_path: Path) -> None:
    """With ``--tenants``, the dashboard's Tenants panel has a row per tenant: its sessions,
    steps and ended episodes move as it runs them (the page sent with an ``operator``
    tenant's token, as a proxy in front would); without tenants the panel stays hidden."""
    page = tab.page
    async with serve("echo") as server:
        await page.goto(server.url + "/dashboard?every=0.2")
        await wait_text(page, "#status", "t.startsWith('live')")
        assert await page.locator("#tenants-panel").is_hidden()
    tokens = {name: f"token-of-{name}-{'x' * 16}" for name in ("alpha", "beta")}
    path = tmp_path / "tenants.toml"
    path.write_text(
        "".join(
            f'[tenants.{name}]\ntoken_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
            for name, token in tokens.items()
        )
        + "operator = true\n"  # beta's token (the page's) reads every tenant's series
    )
    async with serve("benchmark", tenants=str(path)) as server:
        await page.set_extra_http_headers({"Authorization": f"Bearer {tokens['beta']}"})
        await page.goto(server.url + "/dashboard?every=0.2")
        await wait_text(page, "#tenants tbody", "t.includes('alpha') && t.includes('beta')")
        async with AsyncClient(server.url, token=tokens["alpha"]) as env:
            await env.reset()
            for _ in range(3):
                await env.step({"wait_seconds": 0.0})
            await env.reset()  # the first episode ends
        await page.wait_for_function(
            "() => { const r = [...document.querySelectorAll('#tenants tbody tr')]"
            ".map(tr => [...tr.children].map(td => td.textContent));"
            " const a = r.find(c => c[0] === 'alpha'), b = r.find(c => c[0] === 'beta');"
            " return a && b && a[3] === '1' && Number(a[5]) >= 3 && Number(a[8]) >= 1"
            " && b[3] === '0'; }"
        )


# ------------------------------------------------------------------------- web


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_web_plays_an_episode(tab: Tab, transport: str) -> None:
    """``/web`` on ``echo``, under both transports: a form from the action schema; Reset then
    Step show the observation, reward and done, and the history grows; a bad action shows
    its error."""
    page = tab.page
    async with serve("echo", transport) as server:
        await page.goto(server.url + "/web")
        await wait_text(page, "#status", "t === 'session open'")
        assert await page.locator("#f-message").count() == 1
        await page.click("#reset")
        await wait_text(page, "#observation", "t.includes('Echo environment ready')")
        await page.fill("#f-message", "hello there")
        await page.click("#step")
        await wait_text(page, "#observation", "t.includes('hello there')")
        assert await text(page, "#reward") == "1.1"
        assert await text(page, "#done") == "false"
        assert await page.locator("#history tbody tr").count() == 2
        await page.check("#raw-toggle")
        await page.fill("#raw-action", '{"message": 5}')
        await page.click("#step")
        await wait_text(page, "#error", "t.includes('VALIDATION')")
        assert await page.locator("#history tbody tr").count() == 2
        assert await page.locator("#tools-card").is_hidden()  # echo has no tools


async def test_web_episodes_browses_and_steps_through_recordings(tab: Tab, tmp_path: Path) -> None:
    """``/web/episodes`` on a recording server: the episodes listed with their cost, a
    filter (reward, error) narrows them, one opened is stepped through (reset, each step's
    action and observation, a failed step's error), the cost distribution is drawn; the
    JSON API pages and refuses what it cannot answer. ``/dashboard`` shows the cost per
    episode (means per env, the recorded distribution)."""
    from tests.test_ledger import Walker, _episode, _recorded

    page = tab.page
    async with serve(Walker, record=str(tmp_path)) as server:
        url = server.url
        await _episode(url, 1, [0.5, 1.0, 0.25])
        await _episode(url, 2, [0.1, 0.1, 0.1])
        async with AsyncClient(url) as env:
            await env.reset(seed=3)
            with pytest.raises(stadium.ExecutionError):
                await env.step({"n": -1.0})
        await _recorded(tmp_path, 3)
        async with httpx.AsyncClient() as http:
            listed = (await http.post(url + "/web/episodes", json={"limit": 2})).json()
            assert listed["total"] == 3
            assert len(listed["episodes"]) == 2
            assert listed["envs"] == [server.runtime.spec.name]
            missing = await http.post(url + "/web/episodes/one", json={"file": "../x", "row": 0})
            assert missing.status_code == 404
        await page.goto(url + "/web/episodes")
        await wait_text(page, "#count", "t === '3 matching'")
        assert await page.locator("figure.cost").count() == 2  # CPU and wall, one env
        await page.fill("#f-min_reward", "1")
        await page.click("#apply")
        await wait_text(page, "#count", "t === '1 matching'")
        await page.locator("#episodes tr").first.click()
        await wait_text(page, "#step-at", "t.startsWith('reset')")
        await page.click("#step-next")
        await wait_text(page, "#step-at", "t === 'step 1 of 3'")
        assert '"n": 0.5' in await text(page, "#action")
        assert '"t": 1' in await text(page, "#observation")
        await page.keyboard.press("ArrowRight")
        await wait_text(page, "#step-at", "t === 'step 2 of 3'")
        await page.fill("#f-min_reward", "")
        await page.select_option("#f-error", "true")
        await page.click("#apply")
        await wait_text(page, "#count", "t === '1 matching'")
        await page.locator("#episodes tr").first.click()
        await page.click("#step-next")
        await wait_text(page, "#step-error", "t.includes('n must be >= 0')")
        # the dashboard: the mean cost per episode per env, the recorded distribution
        name = server.runtime.spec.name
        await page.goto(url + "/dashboard")
        await wait_text(page, "#episode-costs tbody", f"t.startsWith({name!r})")
        cells = await page.locator("#episode-costs tbody tr").first.locator("td").all_inner_texts()
        assert cells[1] == "3"  # episodes
        assert float(cells[3]) > 0  # mean wall s
        await page.wait_for_selector("#cost-dist figure.cost")
        assert await page.locator("#cost-dist figure.cost").count() == 2
        assert "3 recorded" in await text(page, "#episodes-link")
    async with serve("echo") as plain:
        await page.goto(plain.url + "/web/episodes")
        await wait_text(page, "#error", "t.includes('--record')")


async def test_web_lists_and_calls_tools(tab: Tab) -> None:
    """``/web`` on ``tools``: the tool list shows, and calling a tool shows its result; the
    action form offers the variants (list_tools / call_tool)."""
    page = tab.page
    async with serve("tools") as server:
        await page.goto(server.url + "/web")
        await wait_text(page, "#tools", "t.includes('add_note') && t.includes('calculate')")
        assert await page.locator("#variant option").count() == 2
        await page.select_option("#tool-name", "calculate")
        await page.fill("#tool-args", '{"a": 2, "op": "*", "b": 21}')
        await page.click("#call-tool")
        await wait_text(page, "#tool-result", "t.includes('42')")
        await page.fill("#tool-args", '{"a": 2}')  # op and b missing: the error is shown
        await page.click("#call-tool")
        await wait_text(page, "#tool-result", "t.startsWith('error')")


async def test_web_number_fields_carry_the_schema_bounds(tab: Tab) -> None:
    page = tab.page
    async with serve("benchmark") as server:
        await page.goto(server.url + "/web")
        await wait_text(page, "#status", "t === 'session open'")
        field = page.locator("#f-wait_seconds")
        assert await field.get_attribute("type") == "number"
        assert await field.get_attribute("max") == "3600"
        await page.click("#reset")
        await wait_text(page, "#observation", "t.includes('step_count')")
        await page.fill("#f-wait_seconds", "0")
        await page.click("#step")
        await wait_text(page, "#step-count", "t === '1'")


async def test_pages_obey_enable_web_interface_and_the_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ENABLE_WEB_INTERFACE=false`` removes ``/web`` (not ``/dashboard``); with a token the
    pages are refused like every other endpoint, and served as self-contained HTML."""
    monkeypatch.setenv("ENABLE_WEB_INTERFACE", "false")
    async with serve("echo") as server, httpx.AsyncClient() as http:
        assert (await http.get(server.url + "/web")).status_code == 404
        dash = await http.get(server.url + "/dashboard")
        assert dash.status_code == 200
        assert dash.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in dash.headers["content-security-policy"]
        assert "http" not in dash.text.split("<script>", 1)[1].replace("http://www.w3.org", "")
    monkeypatch.delenv("ENABLE_WEB_INTERFACE")
    token = "t" * 20
    async with serve("echo", auth_token=token) as server, httpx.AsyncClient() as http:
        assert (await http.get(server.url + "/web")).status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        assert (await http.get(server.url + "/web", headers=auth)).status_code == 200


# ---------------------------------------------------------------------- report


def _rows(tmp: Path) -> list[dict[str, Any]]:
    summaries = []
    for n in (4, 8):
        recs = [
            SessionResult(
                index=i, ok=True, start=0.0, end=0.1, connect_s=0.001, reset_s=0.002,
                step_s=[0.01, 0.012], close_s=0.001, total_s=0.05 + i / 1000, host="node1",
            )
            for i in range(n)
        ]  # fmt: skip
        summaries.append(summarize(PointKey("stadium", n, 0.01, 0), recs, PointSettings()))
    report.write_summary(tmp / "summary.csv", summaries)
    return report.read_summary(tmp / "summary.csv")


async def test_report_html_shows_tables_and_figures(tab: Tab, tmp_path: Path) -> None:
    """``report.html`` beside ``report.md``: its tables, and every figure loaded from the page
    itself (embedded), even with the PNG files gone."""
    rows = _rows(tmp_path)
    figures = report.write_figures(tmp_path, rows)
    report.write_report(
        tmp_path, rows, command="stadium bench run", settings={"steps": 2}, figures=figures,
        notes=["a note"], machine={"cores": "4"},
    )  # fmt: skip
    html = tmp_path / "report.html"
    assert html.is_file()
    for f in figures:
        f.unlink()  # the page must not need them
    page = tab.page
    await page.goto(html.as_uri())
    assert await text(page, "h1") == "Stadium benchmark report"
    assert await page.locator("table").count() >= 4
    cells = await page.locator("table").nth(3).locator("tbody tr").all_inner_texts()
    assert len(cells) == 2
    assert cells[0].startswith("stadium")
    images = page.locator("img")
    assert await images.count() == len(report.FIGURES)
    widths = await images.evaluate_all("imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
    assert all(w > 0 for w in widths), widths
    assert "a note" in await text(page, "body")
