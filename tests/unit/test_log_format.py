"""The server's log formats stamp each line as the standard library would, whatever the order of the
records' times (their second's text is remembered from one line to the next)."""

from __future__ import annotations

import json
import logging
import time

from hypothesis import given
from hypothesis import strategies as st

from tally_server.logs import TEXT_FORMAT, JsonFormatter, TextFormatter

# 2001 to 2100, in seconds with their fractions; several records may share a second.
times = st.lists(st.floats(min_value=978_307_200, max_value=4_102_444_800), min_size=1, max_size=20)


def _record(created: float) -> logging.LogRecord:
    record = logging.LogRecord("tally_server.access", logging.INFO, __file__, 1, "call %s", ("ok",), None)
    record.created = created
    record.msecs = (created - int(created)) * 1000
    record.request_id = "r-1"
    return record


@given(times, st.data())
def test_text_lines_are_the_standard_formatters(created: list[float], data: st.DataObject) -> None:
    # Repeats of one second, out of order too: the remembered second must never leak to another.
    created += data.draw(st.lists(st.sampled_from(created), max_size=10))
    ours, standard = TextFormatter(), logging.Formatter(TEXT_FORMAT)
    for when in created:
        record = _record(when)
        assert ours.format(record) == standard.format(record)


@given(times)
def test_json_lines_carry_the_utc_time_to_the_millisecond(created: list[float]) -> None:
    formatter = JsonFormatter()
    for when in created + created[::-1]:
        entry = json.loads(formatter.format(_record(when)))
        msecs = int((when - int(when)) * 1000)
        assert entry["ts"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{msecs:03d}Z"
        assert entry["request_id"] == "r-1"
