"""A chunked HTTP body (no Content-Length) larger than the body limit (bench/faults.py chunked, scaled down).

The coordinator runs with a 1 MiB body limit and gets 8 MB of small deltas: the limit must hold
while the body streams in (413), memory must not grow with the body, and a concurrent keep-alive
must not wait behind it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench._faultlib import chunked
from tally_server.testing import RunningServer, running_server

LIMIT = 1024 * 1024
BODY = 8_000_000


@pytest.fixture(scope="module")
def attacked(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RunningServer, chunked.ChunkedResult]]:
    data: Path = tmp_path_factory.mktemp("chunked") / "data"
    env = {"TALLY_MAX_MESSAGE_BYTES": str(LIMIT)}
    with running_server(data, lease_ttl_s=chunked.LEASE_TTL_S, env=env) as server:
        yield server, chunked.attack(server, BODY)


def test_a_chunked_body_over_the_limit_is_refused_with_413(
    attacked: tuple[RunningServer, chunked.ChunkedResult],
) -> None:
    _, result = attacked
    assert result.status == "HTTP 413"


def test_memory_does_not_grow_with_a_chunked_body(
    attacked: tuple[RunningServer, chunked.ChunkedResult],
) -> None:
    _, result = attacked
    # A limit enforced while streaming holds at most about one limit's worth of body.
    assert result.rss_growth < 10 * LIMIT + 32 * 1024 * 1024, f"RSS grew {result.rss_growth / 1e6:.0f} MB"


def test_the_server_survives_and_no_healthy_writer_expires(
    attacked: tuple[RunningServer, chunked.ChunkedResult],
) -> None:
    server, result = attacked
    assert server.process.poll() is None
    assert result.healthy_expired == []
