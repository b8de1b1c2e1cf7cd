"""What the owner publishes for its replicas is the view's JSON, as ``dataclasses.asdict`` makes it."""

from __future__ import annotations

import dataclasses

from tally_server.domain.ledger import ApplyCounts
from tally_server.service.status import view_json
from tally_server.service.views import CheckpointView, WriterView


def test_view_json_is_asdict_without_the_copies() -> None:
    writers = [
        WriterView(f"w{i}", "host", 7, {"team": "a"}, "open", i, ApplyCounts(1, 2, 3, 4, 5), 1.5, 2.5)
        for i in range(3)
    ]
    view = CheckpointView(
        "run/1", 5, 3, 2, 1, 0, 0, 1.0, 2.0, writers, {"model": "m"}, "owner-1", 1, 3, 10, 5, 2
    )
    assert view_json(view) == dataclasses.asdict(view)
    assert view_json(dataclasses.replace(view, writers=[])) == dataclasses.asdict(
        dataclasses.replace(view, writers=[])
    )
