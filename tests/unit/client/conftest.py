"""Fixtures of the client unit tests; the test doubles live in ``tally_fakes``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tally import Client
from tests.unit.client.tally_fakes import FakeTransport, make_client, no_tally_threads


@pytest.fixture
def fake() -> FakeTransport:
    return FakeTransport()


@pytest.fixture
def client(fake: FakeTransport) -> Iterator[Client]:
    c = make_client(fake)
    yield c
    c.close()
    assert no_tally_threads(), "a writer left its background threads running"
