"""The dashboard at SLURM scale, in headless Chromium against a real ``tally serve``: a checkpoint with
200 live writers from two array jobs (shared labels once, rows grouped by job, sorting, filtering and
paging past 100), and a list of 30 checkpoints under 3 prefixes (a table sorted by name or activity,
grouped by prefix). Fixtures and browser set-up are test_dashboard.py's.
"""

from __future__ import annotations

import random
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

import tally
from tally_server.testing import RunningServer, running_server
from tests.integration.test_dashboard import (  # noqa: F401  (fixtures)
    ARTIFACTS,
    _complete,
    browser_page,
    dash_server,
)

CHECKPOINT = "curation/array"
JOBS = ("100", "200")
TASKS = 100
SHARED = {"pipeline": "curation", "stage": "dedup"}
VIEWPORT = {"width": 1440, "height": 900}


def _row_ids(page: Any) -> list[str]:
    rows = page.get_by_test_id("writer-row")
    ids: list[str] = rows.evaluate_all("rows => rows.map((r) => r.dataset.writer)")
    return ids


def test_two_hundred_writers_share_labels_group_by_job_sort_filter_and_page(
    dash_server: RunningServer,  # noqa: F811
    browser_page: Any,  # noqa: F811
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    page.set_viewport_size(VIEWPORT)
    with tally.Client(dash_server.grpc_address) as client, ExitStack() as stack:
        writers: dict[str, tally.Writer] = {}
        for job in JOBS:
            for task in range(TASKS):
                labels = {**SHARED, "slurm_array_job_id": job, "slurm_array_task_id": str(task)}
                w = client.writer(CHECKPOINT, writer_id=f"{job}-{task}", labels=labels)
                w.open()
                stack.callback(w.close)
                writers[f"{job}-{task}"] = w
        _complete(writers["100-42"], ["s-0"])
        _complete(writers["200-7"], ["s-1", "s-2", "s-3"])

        # The list asks for counts only: its card says 200 live writers, its reply carries none of them.
        with page.expect_response(lambda r: urlsplit(r.url).path == "/v1/checkpoints") as listing:
            page.goto(f"{dash_server.http_url}/")
        assert parse_qs(urlsplit(listing.value.url).query)["writers"] == ["false"]
        listed = {cp["name"]: cp for cp in listing.value.json()["checkpoints"]}
        assert (listed[CHECKPOINT]["live_writers"], listed[CHECKPOINT]["writers"]) == (200, [])
        card = page.get_by_test_id("checkpoint-card").filter(has_text=CHECKPOINT)
        expect(card.get_by_test_id("live-writers").locator(".fv")).to_have_text("200")

        page.goto(f"{dash_server.http_url}/#/checkpoint/curation/array")
        panel = page.get_by_test_id("writers")
        expect(panel.locator(".panel-note")).to_have_text("200 live")
        rows = page.get_by_test_id("writer-row")
        expect(rows).to_have_count(50)  # one page

        # The labels every writer has show once, above the table, and in no row.
        shared = page.get_by_test_id("shared-labels").get_by_test_id("label")
        expect(shared).to_have_text(["pipeline curation", "stage dedup"])
        for name in ("pipeline", "stage", "slurm_array_job_id"):
            expect(rows.get_by_test_id("label").filter(has_text=name)).to_have_count(0)
        # What tells writers apart stays on each row.
        expect(page.locator("[data-writer='100-99']").get_by_test_id("label")).to_have_text(
            ["slurm_array_task_id 99"]
        )

        # Grouped by array job: the first page is all job 100's (the default sort: live, newest first).
        groups = page.get_by_test_id("writer-group")
        expect(groups).to_have_count(1)
        expect(groups).to_have_attribute("data-group", "100")
        expect(groups).to_contain_text("array job 100 · 100 writers · 100 live · 1 completion")
        assert all(i.startswith("100-") for i in _row_ids(page))
        assert _row_ids(page)[0] == "100-99"

        # Sorting by writer id (numbers in order), then paging to the third page: writer #150.
        page.get_by_test_id("writer-sort").get_by_role("button", name="writer id").click()
        expect(rows.first).to_have_attribute("data-writer", "100-0")
        assert _row_ids(page)[:12] == [f"100-{i}" for i in range(12)]
        next_page = page.get_by_test_id("writer-next")
        next_page.click()
        expect(page.get_by_test_id("writer-range")).to_have_text("51–100 of 200")
        expect(rows.first).to_have_attribute("data-writer", "100-50")
        next_page.click()
        expect(page.get_by_test_id("writer-range")).to_have_text("101–150 of 200")
        expect(rows.last).to_have_attribute("data-writer", "200-49")
        expect(page.locator("[data-writer='200-49']")).to_be_visible()
        assert _row_ids(page) == [f"200-{i}" for i in range(50)]
        expect(groups).to_have_attribute("data-group", "200")
        next_page.click()
        expect(page.get_by_test_id("writer-range")).to_have_text("151–200 of 200")
        expect(next_page).to_be_disabled()
        expect(rows.last).to_have_attribute("data-writer", "200-99")

        # Sorting by completions: the busiest writer of each job heads its group (back on page one).
        page.get_by_test_id("writer-sort").get_by_role("button", name="completed").click()
        expect(page.get_by_test_id("writer-range")).to_have_text("1–50 of 200")
        expect(rows.first).to_have_attribute("data-writer", "100-42")

        # Filtering by label: one task of each job, under two group headers.
        search = page.get_by_test_id("writer-filter")
        search.fill("task_id=42")
        expect(rows).to_have_count(2)
        assert _row_ids(page) == ["100-42", "200-42"]
        expect(groups).to_have_count(2)
        expect(page.get_by_test_id("writer-range")).to_have_count(0)  # one page: no pager
        # By writer id, with the busiest first.
        search.fill("200-")
        expect(rows).to_have_count(50)
        assert _row_ids(page)[0] == "200-7"
        expect(page.get_by_test_id("writer-range")).to_have_text("1–50 of 100")
        search.fill("no-such-writer")
        expect(page.get_by_test_id("writers-none")).to_contain_text("No writer matches")
        search.fill("")
        expect(rows).to_have_count(50)

        ARTIFACTS.mkdir(exist_ok=True)
        page.mouse.move(10, 10)
        page.screenshot(path=str(ARTIFACTS / "dashboard-writers-200.png"), full_page=True)


PREFIXES = ("alpha", "beta", "gamma")


def test_the_checkpoint_list_table_sorts_by_name_and_activity_and_groups_by_prefix(
    tmp_path: Path,
    browser_page: Any,  # noqa: F811
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    page.set_viewport_size(VIEWPORT)
    names = [f"{p}/run-{i:02d}" for p in PREFIXES for i in range(10)]
    with running_server(tmp_path / "data", settle_ms=0) as server:
        with tally.Client(server.grpc_address) as client:
            # Activity in an order that is not the names' order.
            for n, name in enumerate(random.Random(7).sample(names, len(names))):
                with client.writer(name, writer_id="w") as w:
                    _complete(w, [f"s-{n}"])
        listed = httpx.get(f"{server.http_url}/v1/checkpoints", timeout=10).json()["checkpoints"]
        activity = {cp["name"]: cp["last_activity_at"] for cp in listed}
        by_name = sorted(names)  # prefix order first, then the name
        by_activity = sorted(names, key=lambda n: (n.split("/")[0], -activity[n], n))
        assert by_activity != by_name

        page.goto(server.http_url + "/")
        expect(page.get_by_test_id("checkpoint-card")).to_have_count(30)
        # Cards group by prefix too.
        expect(page.get_by_test_id("checkpoint-group")).to_have_count(3)

        page.get_by_test_id("list-view").get_by_role("button", name="Table").click()
        rows = page.get_by_test_id("checkpoint-row")
        expect(rows).to_have_count(30)
        expect(page.get_by_test_id("checkpoint-card")).to_have_count(0)
        groups = page.get_by_test_id("checkpoint-group")
        expect(groups).to_have_count(3)
        assert groups.evaluate_all("els => els.map((e) => e.dataset.prefix)") == list(PREFIXES)
        expect(groups.first).to_contain_text("alpha/ · 10 checkpoints")

        def shown() -> list[str]:
            got: list[str] = rows.evaluate_all("els => els.map((e) => e.dataset.name)")
            return got

        expect(page.get_by_test_id("sort-name")).to_have_attribute("aria-pressed", "true")
        assert shown() == by_name
        page.get_by_test_id("sort-activity").click()
        expect(page.get_by_test_id("sort-activity")).to_have_attribute("aria-pressed", "true")
        assert shown() == by_activity
        # Each group's rows sit under its header.
        for prefix in PREFIXES:
            members = page.locator("tbody", has=page.locator(f"[data-prefix='{prefix}']"))
            expect(members.get_by_test_id("checkpoint-row")).to_have_count(10)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-list-table.png"), full_page=True)

        # The choice survives a reload (kept with the other options).
        page.reload()
        expect(rows).to_have_count(30)
        expect(page.get_by_test_id("sort-activity")).to_have_attribute("aria-pressed", "true")
        assert shown() == by_activity
        page.get_by_test_id("sort-name").click()
        expect(page.get_by_test_id("sort-name")).to_have_attribute("aria-pressed", "true")
        assert shown() == by_name


def test_writers_without_array_jobs_group_by_host_and_closed_ones_show_beside_them(
    dash_server: RunningServer,  # noqa: F811
    browser_page: Any,  # noqa: F811
) -> None:
    """Writers opened over HTTP (which names the host): 24 live on two hosts, 2 closed."""
    from playwright.sync_api import expect

    page = browser_page
    page.set_viewport_size(VIEWPORT)
    name = "plain/hosts"
    handles = []
    with httpx.Client(base_url=dash_server.http_url, timeout=10) as http:
        for i in range(26):
            body = {"checkpoint": name, "writer_id": f"w-{i}", "host": f"node-{i % 2}", "pid": 100 + i}
            body["labels"] = {"stage": "embed", "shard": str(i)}
            reply = http.post("/v1/writers", json=body)
            reply.raise_for_status()
            handles.append(reply.json()["handle"])
        for handle in handles[24:]:
            http.post(f"/v1/writers/{handle}/close").raise_for_status()
        # Writers opened over HTTP renew their lease only when told: w-5 is the one seen last.
        http.post(f"/v1/writers/{handles[5]}/keepalive").raise_for_status()

        page.goto(f"{dash_server.http_url}/#/checkpoint/plain/hosts")
        expect(page.get_by_test_id("writers").locator(".panel-note")).to_have_text("24 live · 2 closed")
        rows = page.get_by_test_id("writer-row")
        expect(rows).to_have_count(26)
        expect(page.get_by_test_id("shared-labels").get_by_test_id("label")).to_have_text(["stage embed"])
        groups = page.get_by_test_id("writer-group")
        expect(groups).to_have_count(2)
        assert groups.evaluate_all("els => els.map((e) => e.dataset.group)") == ["node-0", "node-1"]
        expect(groups.first).to_contain_text("host node-0 · 13 writers · 12 live")
        # The filter matches the host; the closed writers are among the rows.
        page.get_by_test_id("writer-filter").fill("node-1")
        expect(rows).to_have_count(13)
        expect(page.locator("[data-writer='w-25']").get_by_test_id("writer-state")).to_have_text("closed")
        page.get_by_test_id("writer-sort").get_by_role("button", name="last seen").click()
        expect(rows.first).to_have_attribute("data-writer", "w-5")
        page.get_by_test_id("writer-sort").get_by_role("button", name="writer id").click()
        expect(rows.first).to_have_attribute("data-writer", "w-1")
        assert rows.evaluate_all("els => els.map((e) => e.dataset.writer)")[:3] == ["w-1", "w-3", "w-5"]
        for handle in handles[:24]:
            http.post(f"/v1/writers/{handle}/close").raise_for_status()
