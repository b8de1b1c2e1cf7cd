"""The real-NeMo tests print their duration breakdown (ray start, each run, ray stop) after each test."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.nemo.nemo_cluster import TIMINGS


@pytest.fixture(autouse=True)
def _print_timings(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> Iterator[None]:
    TIMINGS.clear()
    start = time.monotonic()
    yield
    if not TIMINGS:
        return  # nothing was timed: no Ray cluster, no run
    TIMINGS["whole test"] = time.monotonic() - start
    with capsys.disabled():
        print(f"\n{request.node.name}, seconds:")
        for what, seconds in TIMINGS.items():
            print(f"  {what:<45} {seconds:7.1f}")
