"""Arrays built in PostgreSQL's binary format come back as the values they were built from."""

from __future__ import annotations

import psycopg
import pytest

from tally_server.store.pg_arrays import bytea_array, int4_runs
from tests.conftest import POSTGRES_ADMIN_URL

pytestmark = pytest.mark.postgres


def test_bytea_and_int4_arrays_read_back_as_built() -> None:
    with psycopg.connect(POSTGRES_ADMIN_URL.replace("+psycopg", "")) as conn:
        for values in ([b"a", b"", b"\x00\xff" * 300, "é".encode()], [], [b"x"]):
            got = conn.execute("SELECT %b::bytea[], cardinality(%b::bytea[])", (bytea_array(values),) * 2)
            assert got.fetchone() == (values, len(values))
        for runs in ([(1, 3), (2, 0), (-5, 2), (2**31 - 1, 1)], [], [(7, 0)]):
            got = conn.execute("SELECT %b::int4[]", (int4_runs(runs),))
            assert got.fetchone() == ([value for value, times in runs for _ in range(times)],)
        # Other values keep psycopg's own dumpers.
        assert conn.execute("SELECT %b::bytea, %s::int4[]", (b"ab", [1, 2])).fetchone() == (b"ab", [1, 2])
