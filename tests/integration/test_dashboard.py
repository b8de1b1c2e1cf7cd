"""The dashboard at ``/``, in a real headless Chromium (Debian's ``chromium``, driven by Playwright's Python
package; no browser download) against a real ``tally serve`` fed by the real SDK.

Screenshots go to ``artifacts/``; with TALLY_UPDATE_DOCS_SCREENSHOT=1 the checkpoint page is also copied
to ``docs/img/dashboard.png``, the README's picture.
Without Chromium or Playwright the browser tests skip locally and fail under ``CI``:
``apt-get install -y chromium`` and ``pip install playwright``.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tally
from tally_server.sharding import desired_shards
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree
from tests.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
DOCS_IMG = REPO / "docs" / "img" / "dashboard.png"
CHROMIUM = Path(os.environ.get("TALLY_TEST_CHROMIUM", "/usr/bin/chromium"))
# Without the networking flags Chromium keeps trying to reach Google's services on a closed network.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CHECKPOINT = "curation/run-42"
TIMEOUT_MS = 15_000  # lists are polled every 5 s (2 s after a failure); allow for a loaded CI machine
STATUS_ROUTE = "/v1/checkpoints/{name:tally_any_path}"


def _need_browser() -> None:
    """Skip (locally) or fail (under CI) when the browser or its driver is missing."""
    reasons = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        reasons.append("the playwright package is not installed (pip install playwright)")
    if not CHROMIUM.exists():
        reasons.append(f"no Chromium at {CHROMIUM} (apt-get install -y chromium)")
    if reasons:
        message = "browser test needs a headless Chromium: " + "; ".join(reasons)
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def dash_server(tmp_path: Path) -> Iterator[RunningServer]:
    # Sample progress often so the plot has points within the test's few seconds.
    with running_server(tmp_path / "data", settle_ms=0, env={"TALLY_PROGRESS_INTERVAL_S": "0.2"}) as srv:
        yield srv


@pytest.fixture
def browser_page() -> Iterator[Any]:
    _need_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
            page = context.new_page()
            problems: list[str] = []

            def on_console(msg: Any) -> None:
                # Chromium logs failed requests: a stopped server and a missing token are tested on
                # purpose; any other error the page logs (a 404 from an API it reads, a script error) is not.
                # On /redoc, ReDoc's attribution logo is hard-wired to its CDN: the page's CSP refuses
                # it (nothing leaves the machine) and ReDoc hides the image.
                expected = (
                    "ERR_CONNECTION_REFUSED",
                    "status of 401 (Unauthorized)",
                    "'https://cdn.redoc.ly/redoc/logo-mini.svg' violates the following Content Security",
                )
                # So is a refused (403: a token scoped to some checkpoints) or failed (503) call for the
                # replicas strip: the strip hides, nothing else changes.
                refused_replicas = re.search(r"status of (403|503)\b", msg.text) and urlsplit(
                    msg.location.get("url", "")
                ).path.endswith("/v1/replicas")
                if msg.type == "error" and not refused_replicas and not any(e in msg.text for e in expected):
                    problems.append(f"console.{msg.type}: {msg.text}")

            page.on("pageerror", lambda exc: problems.append(f"uncaught: {exc}"))
            page.on("console", on_console)
            # Everything must come from the coordinator (on loopback here): no CDN, no external font.
            outside: list[str] = []

            def gate(route: Any) -> None:
                url = urlsplit(route.request.url)
                if url.scheme == "data" or url.hostname in ("127.0.0.1", "localhost", "::1"):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()

            page.route(re.compile(".*"), gate)
            yield page
            assert not outside, f"the dashboard fetched from outside the server: {outside}"
            assert not problems, f"the page reported errors: {problems}"
        finally:
            browser.close()


def _complete(writer: tally.Writer, sources: list[str]) -> None:
    writer.apply_deltas([d for source in sources for d in tree(source)])
    writer.flush()


def _wait_sampled(server: RunningServer, count: int) -> None:
    """Until the server has persisted a progress sample with ``count`` (a condition, not a fixed sleep)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        reply = httpx.get(
            f"{server.http_url}/v1/progress", params={"checkpoint": CHECKPOINT, "since": 0}, timeout=10
        )
        reply.raise_for_status()
        persisted = reply.json()["samples"][:-1]  # the last one is the live count "now"
        if persisted and persisted[-1]["completed_count"] == count:
            return
        time.sleep(0.05)
    raise AssertionError(f"no progress sample with completed_count={count} within 30 s")


def _requests(page: Any) -> list[Any]:
    """Every request the page makes from now on (Playwright's request log)."""
    log: list[Any] = []
    page.on("request", lambda request: log.append(request))
    return log


def _paths(log: list[Any], path: str) -> list[str]:
    return [r.url for r in log if urlsplit(r.url).path == path]


def _served(server: RunningServer, route: str) -> float:
    """How many requests the server answered on ``route`` (a template), from its /metrics."""
    reply = httpx.get(f"{server.http_url}/metrics", timeout=10)
    reply.raise_for_status()
    return sum(
        s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
        if s.name == "tally_http_request_duration_seconds_count" and s.labels.get("route") == route
    )


def test_dashboard_shows_a_workload_and_updates_by_itself(
    dash_server: RunningServer, browser_page: Any
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    requests = _requests(page)
    page.goto(dash_server.http_url + "/")
    # An empty server has a friendly state, not a blank page.
    expect(page.get_by_test_id("empty")).to_contain_text("No checkpoints yet")
    page.evaluate("window.__sameDocument = true")  # survives only if nothing reloads the page

    with tally.Client(dash_server.grpc_address) as client:
        # Array task 2 did a share and finished; task 3 is still running.
        with client.writer(CHECKPOINT, writer_id="task-2", labels={"slurm_array_task_id": "2"}) as done:
            for batch in range(3):
                _complete(done, [f"a-{batch}-{i}" for i in range(2)])
                _wait_sampled(dash_server, 2 * (batch + 1))
        with client.writer(CHECKPOINT, writer_id="task-3", labels={"slurm_array_task_id": "3"}) as writer:
            for batch in range(4):
                _complete(writer, [f"b-{batch}-{i}" for i in range(batch + 1)])
                _wait_sampled(dash_server, 6 + (batch + 1) * (batch + 2) // 2)
            writer.apply_deltas([("0_in-flight", "in-flight", 1)])  # one source pending
            writer.acquire(["in-flight"])  # and claimed by its writer
            writer.flush()
            completed = 16

            # The list appears by itself (no reload) with the right count.
            card = page.locator(f"[data-testid='checkpoint-card'][data-name='{CHECKPOINT}']")
            expect(card.get_by_test_id("completed-count")).to_have_text(str(completed))
            expect(card.get_by_test_id("live-writers")).to_contain_text("1")
            expect(card.get_by_test_id("pending")).to_contain_text("1")
            expect(card.get_by_test_id("status")).to_have_text("running")
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard-list.png"), full_page=True)

            # The checkpoint's own page (its name contains "/").
            card.click()
            expect(page).to_have_url(re.compile(r"#/checkpoint/curation/run-42$"))
            expect(page.get_by_test_id("checkpoint-name")).to_contain_text(CHECKPOINT)
            expect(page.get_by_test_id("completed-value")).to_have_text(str(completed))
            expect(page.get_by_test_id("pending-value")).to_have_text("1")
            expect(page.get_by_test_id("live-writers-value")).to_have_text("1")
            expect(page.get_by_test_id("live-writers")).to_contain_text("1 closed · 1 source claimed")

            rows = page.get_by_test_id("writer-row")
            expect(rows).to_have_count(2)
            live = page.locator("[data-testid='writer-row'][data-writer='task-3']")
            expect(live.get_by_test_id("writer-state")).to_have_text("live")
            expect(live.get_by_test_id("label").filter(has_text="slurm_array_task_id")).to_have_text(
                "slurm_array_task_id 3"
            )
            expect(live.get_by_test_id("writer-completed")).to_have_text("10")
            finished = page.locator("[data-testid='writer-row'][data-writer='task-2']")
            expect(finished.get_by_test_id("writer-state")).to_have_text("closed")
            expect(finished.get_by_test_id("label").filter(has_text="slurm_array_task_id")).to_have_text(
                "slurm_array_task_id 2"
            )

            kinds = page.get_by_test_id("event-kind")  # newest first
            expect(kinds).to_have_text(
                ["writer opened", "writer closed", "writer opened", "checkpoint created"]
            )
            expect(page.get_by_test_id("progress-chart")).to_be_visible()
            expect(page.get_by_test_id("rate-value")).to_have_text(re.compile(r"\d"))

            # More completions: the page follows by itself, from the watch stream.
            _complete(writer, [f"c-{i}" for i in range(5)])
            writer.apply_deltas([("0_in-flight_0", "in-flight", -1)])  # the pending one completes too
            writer.flush()
            completed += 6
            expect(page.get_by_test_id("completed-value")).to_have_text(str(completed))
            expect(page.get_by_test_id("pending-value")).to_have_text("0")
            expect(live.get_by_test_id("writer-completed")).to_have_text("16")
            assert page.evaluate("window.__sameDocument") is True, "the page reloaded instead of updating"
            # The status came over one stream, never by polling the checkpoint (in the browser's log
            # and in the server's own count).
            assert not _paths(requests, f"/v1/checkpoints/{CHECKPOINT}"), "the page polled the status"
            assert _served(dash_server, STATUS_ROUTE) == 0
            watches = _paths(requests, "/v1/watch")
            assert len(watches) == 1, watches
            assert "checkpoint=curation%2Frun-42" in watches[0]
            _wait_sampled(dash_server, completed)

            page.mouse.move(10, 10)
            page.screenshot(path=str(ARTIFACTS / "dashboard-checkpoint.png"), full_page=True)
            if os.environ.get("TALLY_UPDATE_DOCS_SCREENSHOT"):  # refresh the README's picture on request
                DOCS_IMG.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ARTIFACTS / "dashboard-checkpoint.png", DOCS_IMG)

    # The writer closed: the page says so without a reload, still on its one stream.
    expect(live.get_by_test_id("writer-state")).to_have_text("closed")
    expect(page.get_by_test_id("live-writers-value")).to_have_text("0")
    assert len(_paths(requests, "/v1/watch")) == 1
    assert _served(dash_server, STATUS_ROUTE) == 0


def test_problems_are_highlighted_and_the_event_log_pages(tmp_path: Path, browser_page: Any) -> None:
    """Anomalies (amber) and an unreadable completion file (red) stand out; "load older" pages the log."""
    from playwright.sync_api import expect

    data = tmp_path / "data"
    metadata = data / "checkpoints" / "sick" / "run" / ".nemo_curator_metadata"
    metadata.mkdir(parents=True)
    (metadata / "gpu-node-3-9.mdb").write_bytes(b"not an lmdb file" * 512)
    sources = [f"s-{i}" for i in range(55)]
    with (
        running_server(data, settle_ms=0) as server,
        tally.Client(server.grpc_address) as client,
        client.writer("sick/run", writer_id="replayer") as writer,
    ):
        _complete(writer, sources)
        # A new task for a source this writer already completed: an anomaly each, one event each
        # in batches of 11 (a batch's anomalies past its first 20 would share one event).
        for first in range(0, len(sources), 11):
            writer.apply_deltas([(f"1_{s}", s, 1) for s in sources[first : first + 11]])
            writer.flush()
        status = client.checkpoint("sick/run")
        assert (status.anomalies, status.unreadable_files) == (55, 1)

        page = browser_page
        page.goto(server.http_url + "/#/checkpoint/sick/run")  # a deep link straight to the page
        expect(page.get_by_test_id("anomalies-value")).to_have_text("55")
        expect(page.get_by_test_id("anomalies")).to_have_class(re.compile(r"\bwarn\b"))
        expect(page.get_by_test_id("unreadable-value")).to_have_text("1")
        expect(page.get_by_test_id("unreadable")).to_have_class(re.compile(r"\bbad\b"))
        expect(page.get_by_test_id("completed")).not_to_have_class(re.compile(r"\b(warn|bad)\b"))

        rows = page.get_by_test_id("event-row")
        expect(rows).to_have_count(50)
        page.get_by_test_id("load-older").click()
        expect(rows).to_have_count(55 + 3)  # and checkpoint_created, unreadable_file, writer_opened
        expect(page.get_by_test_id("events")).to_contain_text("Beginning of the log")
        expect(rows.last.get_by_test_id("event-kind")).to_have_text("checkpoint created")
        expect(page.get_by_test_id("event-kind").filter(has_text="unreadable file")).to_have_class(
            re.compile(r"\bbad\b")
        )
        page.screenshot(path=str(ARTIFACTS / "dashboard-problems.png"), full_page=True)

        page.get_by_text("All checkpoints").click()
        card = page.locator("[data-testid='checkpoint-card'][data-name='sick/run']")
        expect(card).to_have_class(re.compile(r"\bbad\b"))
        expect(card.get_by_test_id("anomalies")).to_have_class(re.compile(r"\bwarn\b"))
        expect(card.get_by_test_id("unreadable")).to_have_class(re.compile(r"\bbad\b"))


def test_failed_sources_show_on_their_checkpoint_and_its_card(tmp_path: Path, browser_page: Any) -> None:
    """A checkpoint with a failure budget shows its failed sources in red; one without shows no tile."""
    import grpc
    from playwright.sync_api import expect

    from tally.v1 import coordinator_pb2 as pb
    from tally.v1 import coordinator_pb2_grpc as pb_grpc

    with (
        running_server(tmp_path / "data", settle_ms=0) as server,
        grpc.insecure_channel(server.grpc_address) as ch,
    ):
        stub = pb_grpc.CoordinatorStub(ch)
        stub.SetFailureBudget(pb.SetFailureBudgetRequest(checkpoint="poison/run", max_attempts=1))
        handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="poison/run", writer_id="w")).handle
        stub.ReportFailure(pb.ReportFailureRequest(handle=handle, source_id="bad", reason="corrupt input"))
        stub.OpenWriter(pb.OpenWriterRequest(checkpoint="fine/run", writer_id="w"))
        page = browser_page
        page.goto(server.http_url + "/#/checkpoint/poison/run")
        expect(page.get_by_test_id("failed-value")).to_have_text("1")
        expect(page.get_by_test_id("failed")).to_have_class(re.compile(r"\bbad\b"))
        expect(page.get_by_test_id("failed")).to_contain_text("1 failed attempt each")
        page.goto(server.http_url + "/#/checkpoint/fine/run")
        expect(page.get_by_test_id("completed-value")).to_have_text("0")
        expect(page.get_by_test_id("failed")).to_have_count(0)
        page.get_by_text("All checkpoints").click()
        card = page.locator("[data-testid='checkpoint-card'][data-name='poison/run']")
        expect(card.get_by_test_id("failed")).to_have_class(re.compile(r"\bbad\b"))
        fine = page.locator("[data-testid='checkpoint-card'][data-name='fine/run']")
        expect(fine.get_by_test_id("failed")).to_have_count(0)


def test_declared_totals_show_a_percent_and_an_eta_only_with_a_total(
    tmp_path: Path, browser_page: Any
) -> None:
    """Declared sources: "N of TOTAL (P %)", a bar and an ETA on the page, the percent on the card;
    a checkpoint without declared sources shows none of them."""
    from playwright.sync_api import expect

    with (
        running_server(tmp_path / "data", settle_ms=0) as server,
        tally.Client(server.grpc_address) as client,
    ):
        client.declare("declared/run", ["a", "b", "c", "d"])
        with client.writer("declared/run", writer_id="w") as w:
            _complete(w, ["a"])
        with client.writer("plain/run", writer_id="w") as w:
            _complete(w, ["a"])
        page = browser_page
        page.goto(server.http_url + "/#/checkpoint/declared/run")
        expect(page.get_by_test_id("of-total")).to_have_text("1 of 4 (25.0 %)")
        expect(page.get_by_test_id("total-bar")).to_have_attribute("max", "4")
        expect(page.get_by_test_id("eta")).to_contain_text("3 remaining")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-totals.png"), full_page=True)
        page.goto(server.http_url + "/#/checkpoint/plain/run")
        expect(page.get_by_test_id("completed-value")).to_have_text("1")
        expect(page.get_by_test_id("of-total")).to_have_count(0)
        expect(page.get_by_test_id("eta")).to_have_count(0)
        page.get_by_text("All checkpoints").click()
        card = page.locator("[data-testid='checkpoint-card'][data-name='declared/run']")
        expect(card.get_by_test_id("percent")).to_have_text("25.0 % of 4")
        plain = page.locator("[data-testid='checkpoint-card'][data-name='plain/run']")
        expect(plain.get_by_test_id("completed-count")).to_have_text("1")
        expect(plain.get_by_test_id("percent")).to_have_count(0)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-totals-list.png"), full_page=True)


def test_the_event_log_styles_each_event_by_its_severity(tmp_path: Path, browser_page: Any) -> None:
    """Warnings amber, errors red, the rest plain: from the severity the server sends, not the kind's name
    (a quarantined file and an ignored fingerprint mismatch have names no pattern of problems knew)."""
    from playwright.sync_api import expect

    data = tmp_path / "data"
    metadata = data / "checkpoints" / "sick" / "run" / ".nemo_curator_metadata"
    metadata.mkdir(parents=True)
    (metadata / "gpu-node-3-9.mdb").write_bytes(b"not an lmdb file" * 512)
    with running_server(data, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        with client.writer("sick/run", writer_id="first", fingerprint={"pipeline": "p-1"}) as writer:
            _complete(writer, ["a"])
            writer.apply_deltas([("0_a_late", "a", -1)])  # a delta for a completed source: an anomaly
            writer.flush()
        # The damaged file is this writer's own: its first commit moves it aside (file_quarantined).
        changed = {"pipeline": "p-2"}
        with client.writer(
            "sick/run", writer_id="gpu-node-3-9", fingerprint=changed, on_mismatch="ignore"
        ) as w:
            _complete(w, ["b"])
        severities = {e.kind: e.severity for e in client.events("sick/run").events}
        assert severities["file_quarantined"] == tally.Severity.ERROR, severities

        page = browser_page
        page.goto(server.http_url + "/#/checkpoint/sick/run")
        kind = page.get_by_test_id("event-kind")
        expect(page.get_by_test_id("event-row")).to_have_count(len(client.events("sick/run").events))
        for text in ("anomaly", "fingerprint mismatch ignored"):
            expect(kind.filter(has_text=text)).to_have_class(re.compile(r"\bwarn\b"))
        for text in ("unreadable file", "file quarantined"):
            expect(kind.filter(has_text=text)).to_have_class(re.compile(r"\bbad\b"))
        for text in ("checkpoint created", "writer closed"):
            for i in range(kind.filter(has_text=text).count()):
                expect(kind.filter(has_text=text).nth(i)).not_to_have_class(re.compile(r"\b(warn|bad|ok)\b"))


def test_dashboard_keeps_retrying_when_the_server_goes_away(tmp_path: Path, browser_page: Any) -> None:
    """An error shows a banner and the page recovers by itself when the server is back."""
    from playwright.sync_api import expect

    page = browser_page
    with running_server(tmp_path / "flaky", settle_ms=0) as first:
        address = first.http_address
        page.goto(first.http_url + "/")
        expect(page.get_by_test_id("empty")).to_be_visible()
    expect(page.locator("#banner")).to_contain_text("Can't reach the Tally server")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "error")
    # Back on the same address (and data): the open page finds it again.
    with running_server(tmp_path / "flaky", settle_ms=0, http_listen=address) as second:
        with tally.Client(second.grpc_address) as client, client.writer("back/again") as writer:
            _complete(writer, ["x"])
            card = page.locator("[data-testid='checkpoint-card'][data-name='back/again']")
            expect(card.get_by_test_id("completed-count")).to_have_text("1")
            expect(page.locator("#banner")).to_be_hidden()
            expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")


def test_the_checkpoint_page_reconnects_its_stream(tmp_path: Path, browser_page: Any) -> None:
    """A stopped server ends the stream: the banner says so, and the page streams again once it is back."""
    from playwright.sync_api import expect

    page = browser_page
    requests = _requests(page)
    with running_server(tmp_path / "flaky", settle_ms=0) as first:
        address = first.http_address
        with tally.Client(first.grpc_address) as client, client.writer("back/again") as writer:
            _complete(writer, ["x"])
        page.goto(first.http_url + "/#/checkpoint/back/again")
        expect(page.get_by_test_id("completed-value")).to_have_text("1")
    expect(page.locator("#banner")).to_contain_text("Can't reach the Tally server")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "error")
    expect(page.get_by_test_id("completed-value")).to_have_text("1")  # what it knew stays on screen
    with running_server(tmp_path / "flaky", settle_ms=0, http_listen=address) as second:
        with tally.Client(second.grpc_address) as client, client.writer("back/again") as writer:
            _complete(writer, ["y"])
            expect(page.get_by_test_id("completed-value")).to_have_text("2")
            expect(page.get_by_test_id("live-writers-value")).to_have_text("1")
            expect(page.locator("#banner")).to_be_hidden()
            expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
            assert _served(second, STATUS_ROUTE) == 0
    assert len(_paths(requests, "/v1/watch")) >= 2


def test_the_event_stream_parser_takes_any_chunking(dash_server: RunningServer, browser_page: Any) -> None:
    """Events split anywhere across network chunks (even inside a CRLF) come out whole, in order."""
    page = browser_page
    page.goto(dash_server.http_url + "/")
    events = page.evaluate(
        """async () => {
            const { SseParser } = await import("./ui/api.js");
            const text = ': a comment\\r\\ndata: {"n": 1}\\r\\n\\r\\n'
                + 'data:{"n":\\ndata: 2}\\n\\n'
                + 'id: 7\\rdata: 3\\r\\r\\n';
            const out = [];
            for (let size = 1; size <= text.length; size++) {
                const parser = new SseParser();
                const got = [];
                for (let i = 0; i < text.length; i += size) got.push(...parser.push(text.slice(i, i + size)));
                out.push(got);
            }
            return out;
        }"""
    )
    assert all(got == ['{"n": 1}', '{"n":\n2}', "3"] for got in events), events


def test_a_server_with_tokens_asks_for_one(tmp_path: Path, browser_page: Any) -> None:
    """With authentication on, the page (static, open) asks for a token and reads with a reader's."""
    from playwright.sync_api import expect

    env = {"TALLY_TOKENS": "r3ader:reader,w0rker:worker"}
    with (
        running_server(tmp_path / "data", settle_ms=0, env=env) as server,
        tally.Client(server.grpc_address, token="w0rker") as client,
        client.writer("secured/run") as writer,
    ):
        _complete(writer, ["a", "b"])
        page = browser_page
        page.goto(server.http_url + "/")
        form = page.get_by_test_id("signin")
        expect(form).to_contain_text("needs a token")
        form.get_by_label("Bearer token").fill("wrong")
        form.get_by_role("button", name="Sign in").click()
        expect(page.get_by_test_id("auth-error")).to_contain_text("not accepted")
        form.get_by_label("Bearer token").fill("r3ader")
        form.get_by_role("button", name="Sign in").click()
        card = page.locator("[data-testid='checkpoint-card'][data-name='secured/run']")
        expect(card.get_by_test_id("completed-count")).to_have_text("2")

        # The checkpoint's live status streams with the token (EventSource could not send it).
        requests = _requests(page)
        card.click()
        expect(page.get_by_test_id("completed-value")).to_have_text("2")
        _complete(writer, ["c"])
        expect(page.get_by_test_id("completed-value")).to_have_text("3")
        watches = [r for r in requests if urlsplit(r.url).path == "/v1/watch"]
        assert [w.all_headers().get("authorization") for w in watches] == ["Bearer r3ader"]

        # Forgetting the token drops the stream that carries it.
        page.get_by_role("button", name="Forget token").click()
        expect(page.get_by_test_id("signin")).to_be_visible()


def _replicas_call(token: str = "") -> Any:
    """Matches the page's /v1/replicas answers (to a request with ``token``, if given)."""

    def match(response: Any) -> bool:
        if urlsplit(response.url).path != "/v1/replicas":
            return False
        return not token or response.request.headers.get("authorization") == f"Bearer {token}"

    return match


@pytest.mark.postgres
def test_the_replicas_of_a_postgresql_store_show_through_any_replica(
    tmp_path: Path, postgres_url: str, browser_page: Any
) -> None:
    """Two coordinators on one store, the page loaded through the replica: the strip lists both, the owner
    marked (answered by the replica itself), and a checkpoint's page names the owner (forwarded to it)."""
    from playwright.sync_api import expect

    with (
        running_server(
            tmp_path / "r0", store=postgres_url, settle_ms=0, env={"TALLY_REPLICA_NAME": "pg-owner"}
        ) as owner,
        running_server(
            tmp_path / "r1", store=postgres_url, settle_ms=0, env={"TALLY_REPLICA_NAME": "pg-replica"}
        ) as replica,
    ):
        assert "serving as a replica" in replica.log(), replica.log()
        with tally.Client(replica.grpc_address) as client, client.writer("rep/run", writer_id="w1") as writer:
            _complete(writer, ["a", "b"])
        page = browser_page
        with page.expect_response(_replicas_call()) as answer:
            page.goto(replica.http_url + "/")
        assert answer.value.ok
        panel = page.get_by_test_id("replicas")
        expect(panel.get_by_test_id("replica")).to_have_count(2)
        mine = panel.locator("[data-testid='replica'][data-name='pg-owner']")
        expect(mine).to_have_attribute("data-role", "owner")
        expect(mine.get_by_test_id("replica-role")).to_have_text("owner")
        expect(mine.get_by_test_id("replica-role")).to_have_class(re.compile(r"\bok\b"))
        expect(mine.get_by_test_id("replica-grpc")).to_have_text(owner.grpc_address)
        other = panel.locator("[data-testid='replica'][data-name='pg-replica']")
        expect(other).to_have_attribute("data-role", "replica")
        expect(other.get_by_test_id("replica-role")).to_have_text("replica")
        expect(other.get_by_test_id("replica-grpc")).to_have_text(replica.grpc_address)
        for row in (mine, other):  # both renew their rows every second
            expect(row).to_have_attribute("data-alive", "true")
            expect(row.get_by_test_id("replica-seen")).to_have_text(re.compile(r"^last seen \d+ s ago$"))
        expect(panel.get_by_test_id("replicas-epoch")).to_have_text("epoch 1")
        expect(panel.get_by_test_id("replicas-answered-by")).to_have_text("pg-replica")
        expect(page.locator("#banner")).to_be_hidden()
        card = page.locator("[data-testid='checkpoint-card'][data-name='rep/run']")
        expect(card.get_by_test_id("completed-count")).to_have_text("2")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-replicas.png"), full_page=True)

        card.click()
        expect(page.get_by_test_id("completed-value")).to_have_text("2")
        expect(page.get_by_test_id("owner")).to_have_text("Owner: pg-owner")


@pytest.mark.postgres
def test_on_a_store_of_several_shards_each_coordinator_shows_the_shards_it_owns(
    tmp_path: Path, postgres_url: str, browser_page: Any
) -> None:
    """Two coordinators sharing a store of 4 shards: each row of the strip says which shards it owns."""
    from playwright.sync_api import expect

    shards = ["--store-shards", "4"]
    with (
        running_server(
            tmp_path / "a", store=postgres_url, args=shards, env={"TALLY_REPLICA_NAME": "sh-a"}
        ) as a,
        running_server(tmp_path / "b", store=postgres_url, args=shards, env={"TALLY_REPLICA_NAME": "sh-b"}),
        tally.Client(a.grpc_address) as client,
    ):

        def owned() -> dict[str, tuple[int, ...]]:
            return {r.name: r.shards for r in client.replicas().replicas}

        # The split the two settle on (rendezvous hashing); a shard handed over in place can be seen
        # on its way (one holding three, the other one) before it.
        split = {n: tuple(sorted(desired_shards(4, ["sh-a", "sh-b"], n))) for n in ("sh-a", "sh-b")}
        wait_until(lambda: owned() == split, timeout=60, what="the shards split between the two")
        page = browser_page
        page.goto(a.http_url + "/")
        panel = page.get_by_test_id("replicas")
        expect(panel.get_by_test_id("replica")).to_have_count(2)
        for name, held in split.items():
            row = panel.locator(f"[data-testid='replica'][data-name='{name}']")
            expect(row).to_have_attribute("data-role", "owner")
            expect(row.get_by_test_id("replica-role")).to_have_text("owner of " + ", ".join(map(str, held)))


def test_the_lmdb_store_and_a_scoped_token_show_no_replicas(tmp_path: Path, browser_page: Any) -> None:
    """LMDB lists no replicas: no strip. A token scoped to a prefix may not list them (403): no strip, no
    banner, the list as usual, and the page stops asking for them with that token."""
    from playwright.sync_api import expect

    env = {"TALLY_TOKENS": "r3ader:reader,sc0ped:reader@team-a/,w0rker:worker"}
    with (
        running_server(tmp_path / "data", settle_ms=0, env=env) as server,
        tally.Client(server.grpc_address, token="w0rker") as client,
        client.writer("team-a/run") as writer,
    ):
        _complete(writer, ["a"])
        page = browser_page
        page.goto(server.http_url + "/")
        page.get_by_test_id("signin").get_by_label("Bearer token").fill("r3ader")
        with page.expect_response(_replicas_call("r3ader")) as answer:
            page.get_by_test_id("signin").get_by_role("button", name="Sign in").click()
        assert answer.value.json() == {"replicas": [], "epoch": 0, "answered_by": ""}
        card = page.locator("[data-testid='checkpoint-card'][data-name='team-a/run']")
        expect(card.get_by_test_id("completed-count")).to_have_text("1")
        expect(page.get_by_test_id("replicas")).to_have_count(0)

        page.get_by_role("button", name="Forget token").click()
        requests = _requests(page)
        page.get_by_test_id("signin").get_by_label("Bearer token").fill("sc0ped")
        with page.expect_response(_replicas_call("sc0ped")) as answer:
            page.get_by_test_id("signin").get_by_role("button", name="Sign in").click()
        assert answer.value.status == 403
        expect(card.get_by_test_id("completed-count")).to_have_text("1")
        expect(page.get_by_test_id("replicas")).to_have_count(0)
        expect(page.locator("#banner")).to_be_hidden()
        expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
        # The next poll of the list comes without another refused call for the strip.
        with page.expect_response(lambda r: urlsplit(r.url).path == "/v1/checkpoints", timeout=TIMEOUT_MS):
            pass
        scoped = [
            r
            for r in requests
            if urlsplit(r.url).path == "/v1/replicas" and r.headers.get("authorization") == "Bearer sc0ped"
        ]
        assert len(scoped) == 1, scoped


def test_a_replica_that_stopped_renewing_is_flagged_and_a_failing_listing_hides_the_strip(
    dash_server: RunningServer, browser_page: Any
) -> None:
    """Silent for 5 s or more: "not alive" in red. Any failure of /v1/replicas: no strip, no banner."""
    from playwright.sync_api import expect

    with tally.Client(dash_server.grpc_address) as client, client.writer("any/run") as writer:
        _complete(writer, ["a"])

    def replica(name: str, owner: bool, silent_s: float) -> dict[str, Any]:
        host = "10.0.0.1" if owner else "10.0.0.2"
        return {
            "name": name,
            "grpc_address": f"{host}:50051",
            "http_address": f"{host}:8080",
            "owner": owner,
            "started_at": time.time() - 600,
            "silent_s": silent_s,
        }

    listing = {
        "replicas": [replica("b-gone", False, 12.4), replica("a-owner", True, 0.3)],
        "epoch": 3,
        "answered_by": "a-owner",
    }
    failing = False

    def answer(route: Any) -> None:
        if failing:
            route.fulfill(status=503, json={"error": {"code": "UNAVAILABLE", "message": "database down"}})
        else:
            route.fulfill(json=listing)

    page = browser_page
    page.route(re.compile(r".*/v1/replicas$"), answer)
    page.goto(dash_server.http_url + "/")
    rows = page.get_by_test_id("replica")
    expect(rows).to_have_count(2)
    expect(rows.first).to_have_attribute("data-name", "a-owner")  # the owner first
    gone = page.locator("[data-testid='replica'][data-name='b-gone']")
    expect(gone).to_have_attribute("data-alive", "false")
    expect(gone.get_by_test_id("replica-seen")).to_have_text("last seen 12 s ago · not alive")
    expect(gone.get_by_test_id("replica-seen")).to_have_class(re.compile(r"\bbad\b"))
    expect(rows.first.get_by_test_id("replica-seen")).to_have_text("last seen 0 s ago")
    expect(page.get_by_test_id("replicas-epoch")).to_have_text("epoch 3")

    failing = True
    expect(page.get_by_test_id("replicas")).to_have_count(0)  # at the next poll
    expect(page.locator("#banner")).to_be_hidden()
    expect(page.locator("[data-testid='checkpoint-card'][data-name='any/run']")).to_be_visible()


def test_page_and_assets_are_served_by_the_coordinator(dash_server: RunningServer) -> None:
    """No browser needed: / and /ui/* come from the package, with a strict CSP and revalidation."""
    base = dash_server.http_url
    with httpx.Client(base_url=base, timeout=10) as http:
        index = http.get("/")
        assert index.status_code == 200
        assert index.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in index.headers["content-security-policy"]
        # Only relative, same-origin references: works behind a path prefix and air-gapped.
        refs = re.findall(r'(?:src|href)="([^"]+)"', index.text)
        assert "ui/app.js" in refs and "ui/style.css" in refs
        assert not [r for r in refs if re.match(r"(https?:)?//", r)], refs
        assert '<script type="module" src="ui/app.js">' in index.text  # the CSP's 'self' covers modules

        script = http.get("/ui/app.js")
        assert script.status_code == 200
        assert script.headers["content-type"].startswith("text/javascript")
        assert script.headers["cache-control"] == "no-cache"
        again = http.get("/ui/app.js", headers={"If-None-Match": script.headers["etag"]})
        assert again.status_code == 304
        # Every module app.js imports, and theirs, is served, by relative path only.
        seen, todo = set(), ["app.js"]
        while todo:
            name = todo.pop()
            seen.add(name)
            module = http.get(f"/ui/{name}")
            assert module.status_code == 200 and module.headers["content-type"].startswith("text/javascript")
            for spec in re.findall(r'^import .* from "([^"]+)";$', module.text, re.M):
                assert spec.startswith(("./", "../")), (name, spec)
                target = os.path.normpath(os.path.join(os.path.dirname(name), spec))
                if target not in seen:
                    todo.append(target)
        assert {"api.js", "live.js", "state.js", "views/checkpoint.js"} <= seen
        assert http.get("/ui/style.css").headers["content-type"].startswith("text/css")
        for missing in ("/ui/nope.js", "/ui/__init__.py", "/ui/..%2F__init__.py", "/ui/views"):
            assert http.get(missing).status_code == 404, missing
        # The dashboard routes stay out of the API schema.
        paths = http.get("/openapi.json").json()["paths"]
        assert "/" not in paths and not [p for p in paths if p.startswith("/ui")]


def test_the_api_reference_pages_render_offline(dash_server: RunningServer, browser_page: Any) -> None:
    # browser_page fails the test on any request outside the server and on any console error (a CSP
    # refusal is one), so these pages work on an air-gapped cluster.
    from playwright.sync_api import expect

    page = browser_page
    page.goto(f"{dash_server.http_url}/docs")
    # Swagger UI read /openapi.json: operations by their tally.v1 names, and the bearer scheme.
    expect(
        page.locator(".opblock-summary-operation-id", has_text=re.compile("^ApplyDeltas$"))
    ).to_be_visible()
    expect(page.locator("button.authorize")).to_be_visible()
    # "Try it out" calls the server from the page (the CSP's connect-src).
    page.locator("#operations-health-CheckLiveness").click()
    page.get_by_role("button", name="Try it out").click()
    page.get_by_role("button", name="Execute").click()
    expect(page.locator(".live-responses-table tr.response td.response-col_status").first).to_have_text("200")
    expect(page.locator(".live-responses-table .microlight").first).to_contain_text('"status": "ok"')
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "api-docs.png"))

    page.goto(f"{dash_server.http_url}/redoc")
    expect(page.get_by_role("heading", name=re.compile("^Tally coordinator"))).to_be_visible()
    expect(page.get_by_text("/v1/writers/{handle}/deltas").first).to_be_attached()
    page.screenshot(path=str(ARTIFACTS / "api-redoc.png"))
