"""The fault campaign's sweep of malformed requests over both transports (bench/faults.py bad_requests).

One sweep (44 requests) against one coordinator with a 2 s lease, then each test checks one
promise: no server error, answers as the contract says, no traceback, a refused OpenWriter
leaves nothing behind, and leases still expire afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench._faultlib import bad_requests
from tally_server.testing import running_server


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[bad_requests.SweepResult]:
    data = tmp_path_factory.mktemp("sweep") / "data"
    with running_server(data, lease_ttl_s=bad_requests.LEASE_TTL_S) as server:
        yield bad_requests.sweep(server)


def _listed(answers: list[bad_requests.Answer]) -> str:
    return "; ".join(f"{a.case}: {a.got}" for a in answers)


def test_the_sweep_covers_both_transports(sweep: bad_requests.SweepResult) -> None:
    transports = {a.case.split()[0] for a in sweep.answers}
    assert transports == {"HTTP", "gRPC"}
    assert len(sweep.answers) >= 40


def test_no_request_gets_a_server_error(sweep: bad_requests.SweepResult) -> None:
    assert not sweep.errors, _listed(sweep.errors)


def test_every_refusal_has_the_contracts_code(sweep: bad_requests.SweepResult) -> None:
    assert not sweep.unexpected, _listed(sweep.unexpected)


def test_bad_requests_log_no_traceback(sweep: bad_requests.SweepResult) -> None:
    assert sweep.tracebacks == 0


def test_a_refused_open_leaves_no_writer_behind(sweep: bad_requests.SweepResult) -> None:
    assert sweep.writers_left_live == []


def test_a_silent_writer_still_expires_after_the_sweep(sweep: bad_requests.SweepResult) -> None:
    assert sweep.silent_writer_expired
