"""The SDK is typed for its users: ``py.typed`` ships, and mypy checks user code against it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import tally

USER_CODE = textwrap.dedent(
    """
    from datetime import datetime

    import tally

    client = tally.Client("grpc://coordinator:50051")
    writer = client.writer("cp", on_mismatch="rest")
    reveal_type(writer.health().buffered)
    ok = client.writer("cp", on_mismatch="reset")

    status = client.checkpoint("cp")
    created: datetime = status.created_at_dt
    print(created.astimezone().isoformat(), status.created_at + 1.0)
    reveal_type(status.writers[0].closed_at_dt)
    reveal_type(client.events("cp").events[0].at_dt)
    """
)


def test_py_typed_ships_with_the_package() -> None:
    assert (Path(tally.__file__).parent / "py.typed").is_file()


def test_mypy_checks_user_code_against_the_sdk(tmp_path: Path) -> None:
    # A fresh mypy run outside the repository's config: what a user's project sees.
    (tmp_path / "user.py").write_text(USER_CODE)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout
    assert "missing library stubs or py.typed marker" not in out, out
    assert 'Revealed type is "int"' in out, out
    # on_mismatch is a Literal: a typo is caught before the coordinator refuses it.
    assert 'Argument "on_mismatch" to "writer" of "Client" has incompatible type' in out, out
    assert "\"Literal['refuse', 'reset', 'ignore']\"" in out, out
    # The datetime properties are typed; the float fields stay floats; nothing else is an error.
    assert 'Revealed type is "datetime.datetime | None"' in out, out
    assert 'Revealed type is "datetime.datetime"' in out, out
    assert "Found 1 error in 1 file" in out, out


def test_every_time_field_has_a_utc_datetime_property_beside_its_float() -> None:
    moment = datetime(2026, 12, 4, 21, 56, 23, 500000, tzinfo=UTC)
    at = moment.timestamp()
    writer = tally.WriterStatus("w", "h", 1, {}, "open", 0, tally.ApplyCounts(), at, at + 2)
    assert writer.opened_at == at  # the float is unchanged
    assert writer.opened_at_dt == moment and writer.opened_at_dt.tzinfo is UTC
    assert writer.last_seen_at_dt == moment + timedelta(seconds=2)
    assert writer.closed_at_dt is None  # 0: still open
    closed = dataclasses.replace(writer, closed_at=at + 3)
    assert closed.closed_at_dt == moment + timedelta(seconds=3)
    status = tally.CheckpointStatus("cp", 0, 0, 0, 0, 0, 0, at, at + 1, (writer,), {})
    assert status.created_at_dt == moment and status.last_activity_at_dt == moment + timedelta(seconds=1)
    assert tally.Event(1, "cp", "writer_opened", "m", at, "w", {}).at_dt == moment
    assert tally.ProgressSample(at, 3).at_dt == moment
    assert tally.FailedAttempt("boom", at, "w").at_dt == moment
    assert tally.Claim("s", "held", holder="w2", until=at).until_dt == moment
    assert tally.Claim("s", "acquired", token=4).until_dt is None
    assert tally.Replica("r", "g", "h", True, at, 0.5).started_at_dt == moment
    # Every public type's float time field has its property (a new one cannot be forgotten).
    times = [
        (cls.__name__, f.name)
        for cls in (getattr(tally, name) for name in tally.__all__)
        if dataclasses.is_dataclass(cls)
        for f in dataclasses.fields(cls)
        if f.type == "float" and (f.name.endswith("_at") or f.name in ("at", "until"))
    ]
    assert len(times) == 10, times
    for cls_name, name in times:
        assert isinstance(getattr(getattr(tally, cls_name), f"{name}_dt", None), property), (cls_name, name)
