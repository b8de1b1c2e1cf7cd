"""The dashboard's checkpoint page with many live writers: does it stay responsive?

    .venv/bin/python bench/dashboard.py [--writers 200] [--seconds 30]

Starts a real ``tally serve``, opens W writers with SLURM-like labels that keep completing sources (each
flushes a batch every 0.5-3 s), opens the checkpoint's page in headless Chromium (Debian's ``chromium``,
driven by Playwright) and prints, over the measured window:

* render time: the page's own ``tally:render`` measure (building the view and morphing it into the page);
* long tasks: stretches over 50 ms when the page could not answer input (the browser's Long Tasks API);
* input to frame: clicking a range button of the plot until the frame showing it pressed;
* the requests the page made, per path (the live status streams; the rest is polled).

The first half of the window the page is left alone, the second half a range button is clicked every 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

CHECKPOINT = "bench/dashboard"
CHROMIUM = Path(os.environ.get("TALLY_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
]

# Installed before the page's own scripts: collects what the page measures and what the browser reports.
OBSERVE = """
window.__bench = { renders: [], longtasks: [] };
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) if (e.name === "tally:render") window.__bench.renders.push(e.duration);
}).observe({ type: "measure" });
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__bench.longtasks.push(e.duration);
}).observe({ type: "longtask" });
"""

# Click a range button; resolve with the ms until a frame shows it pressed.
CLICK = """
async (key) => {
  const button = () => document.querySelector(`[data-range="${key}"]`);
  const started = performance.now();
  button().click();
  while (button().getAttribute("aria-pressed") !== "true") await new Promise(requestAnimationFrame);
  await new Promise(requestAnimationFrame);
  return performance.now() - started;
}
"""


def deltas(sid: str) -> list[tuple[str, str, int]]:
    root = f"0_{sid}"
    return [(root, sid, 1), (f"{root}_0", sid, 1), (f"{root}_0_0", sid, -1), (f"{root}_0_1", sid, -1)]


async def feed(address: str, writers: int, opened: threading.Event, stop: threading.Event) -> None:
    import tally

    async with tally.AsyncClient(address) as client:
        ws = [
            client.writer(
                CHECKPOINT,
                writer_id=f"task-{i}",
                labels={"slurm_job_id": "8812345", "slurm_array_task_id": str(i), "node": f"gpu-{i // 8}"},
            )
            for i in range(writers)
        ]
        await asyncio.gather(*(w.open() for w in ws))
        opened.set()

        async def run(i: int, w: Any) -> None:
            rng = random.Random(i)
            n = 0
            while not stop.is_set():
                await asyncio.sleep(rng.uniform(0.5, 3.0))
                for _ in range(rng.randint(1, 3)):
                    w.apply_deltas(deltas(f"w{i}-s{n}"))
                    n += 1
                await w.flush()

        await asyncio.gather(*(run(i, w) for i, w in enumerate(ws)))
        await asyncio.gather(*(w.close() for w in ws))


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()

    from playwright.sync_api import expect, sync_playwright

    from tally_server.testing import running_server

    with (
        tempfile.TemporaryDirectory(prefix="tally-bench-") as tmp,
        running_server(Path(tmp) / "data", settle_ms=0, env={"TALLY_PROGRESS_INTERVAL_S": "1"}) as server,
    ):
        opened, stop = threading.Event(), threading.Event()
        feeder = threading.Thread(
            target=lambda: asyncio.run(feed(server.grpc_address, args.writers, opened, stop)), daemon=True
        )
        feeder.start()
        if not opened.wait(120):
            raise SystemExit("the writers did not open within 120 s")

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.add_init_script(OBSERVE)
            requests: Counter[str] = Counter()
            page.on("request", lambda r: requests.update([urlsplit(r.url).path]))
            started = time.monotonic()
            page.goto(f"{server.http_url}/#/checkpoint/{CHECKPOINT}")
            rows = page.get_by_test_id("writer-row")
            expect(rows).to_have_count(min(args.writers, 50), timeout=60_000)  # one page of the table
            first = time.monotonic() - started

            # First half: the page left alone (what a wall screen costs); second half: someone clicking.
            reset = "window.__bench.renders = []; window.__bench.longtasks = []"
            measured: dict[str, Any] = {}
            clicks: list[float] = []
            for phase in ("idle", "clicking"):
                page.evaluate(reset)
                requests.clear()
                keys = ["15m", "1h", "6h", "1h"]
                deadline = time.monotonic() + args.seconds / 2
                while time.monotonic() < deadline:
                    if phase == "clicking":
                        clicks.append(page.evaluate(CLICK, keys[len(clicks) % len(keys)]))
                    page.wait_for_timeout(2000)
                measured[phase] = {**page.evaluate("window.__bench"), "requests": dict(requests)}
            measured.update(
                page.evaluate(
                    "({nodes: document.getElementsByTagName('*').length,"
                    " heap: performance.memory ? performance.memory.usedJSHeapSize : 0,"
                    " completed: document.querySelector('[data-testid=completed-value]').textContent})"
                )
            )
            shot = Path(tempfile.gettempdir()) / "tally-bench-dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        stop.set()
        feeder.join(60)

    half = args.seconds / 2
    print(f"dashboard, checkpoint page, {args.writers} live writers, {half:g} s alone, {half:g} s clicked")
    print(f"  first page with its writer rows: {first:.1f} s; {rows_note(args.writers)}")
    for phase in ("idle", "clicking"):
        renders, longtasks = measured[phase]["renders"], measured[phase]["longtasks"]
        print(f"  {phase}:")
        if renders:
            print(
                f"    render: {len(renders)} renders, median {statistics.median(renders):.1f} ms, "
                f"p95 {pct(renders, 0.95):.1f} ms, max {max(renders):.1f} ms"
            )
        else:
            print("    render: not measured (this page has no tally:render measure)")
        print(
            f"    long tasks (> 50 ms): {len(longtasks)}, {sum(longtasks):.0f} ms in all"
            + (f", longest {max(longtasks):.0f} ms" if longtasks else "")
        )
        made = measured[phase]["requests"]
        print("    requests: " + (", ".join(f"{p} {n}" for p, n in sorted(made.items())) or "none"))
    print(
        f"  input to frame (range button): median {statistics.median(clicks):.0f} ms, "
        f"max {max(clicks):.0f} ms over {len(clicks)} clicks"
    )
    print(f"  DOM elements {measured['nodes']}, JS heap {measured['heap'] / 2**20:.1f} MiB")
    print(f"  completed at the end: {measured['completed']}; screenshot {shot}")


def rows_note(writers: int) -> str:
    return "the table shows the 100 most recent writers" if writers > 100 else f"{writers} rows"


if __name__ == "__main__":
    main()
