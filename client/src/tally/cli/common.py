"""What every ``tally`` operator command shares: the consoles, the connection options, errors as
one red line, and the formatting of ages, times and labels."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import json
import os
import pathlib
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

import tally
from tally._words import count as count  # the CLI commands use it from here

# In a pipe or a file nothing is cut or wrapped (rich would fit 80 columns): identifiers stay
# whole, so `tally status | grep run-42` finds run-42.
_PIPE_WIDTH = 100_000


def _stdout() -> Console:
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=_PIPE_WIDTH)


out = _stdout()
err = Console(stderr=True, highlight=False, soft_wrap=True)

Address = Annotated[
    str,
    typer.Option(
        "--address",
        envvar="TALLY_ADDRESS",
        help=(
            "Coordinator: host:port or grpc://, grpcs://, http://, https://; replicas as a "
            "comma-separated list."
        ),
    ),
]
Token = Annotated[str | None, typer.Option("--token", envvar="TALLY_TOKEN", help="Bearer token.")]
Timeout = Annotated[
    float,
    typer.Option(
        "--timeout",
        envvar="TALLY_TIMEOUT",
        min=0.001,
        help="Seconds to wait for the coordinator.",
    ),
]


class Output(enum.StrEnum):
    """What a listing command prints: its table, the table with every column, or JSON."""

    TABLE = "table"
    WIDE = "wide"
    JSON = "json"


OutputFormat = Annotated[
    Output,
    typer.Option(
        "--output",
        "-o",
        case_sensitive=False,
        help="table (the default), wide (every column: full times, counts, labels), or json (one "
        "JSON document on stdout: the SDK's fields, times as seconds since the epoch).",
    ),
]


def fail(message: str) -> typer.Exit:
    """Print ``message`` as one red line on stderr; return the exit to raise."""
    err.print(f"error: {message}", style="red", markup=False)
    return typer.Exit(1)


def warn(message: str) -> None:
    err.print(f"warning: {message}", style="yellow", markup=False)


@contextlib.contextmanager
def connect(address: str, token: str | None, timeout: float) -> Iterator[tally.Client]:
    """A client of the coordinator whose errors end the command with one red line."""
    try:
        client = tally.Client(address, token=token, timeout=timeout)
    except (ValueError, ModuleNotFoundError) as exc:  # an address the SDK cannot parse, or not speak
        raise fail(str(exc)) from None
    try:
        with client:
            yield client
    except tally.TallyError as exc:
        raise fail(exc.message) from None


# --------------------------------------------------------------------------- JSON


def plain(value: Any) -> Any:
    """``value`` as JSON data: a dataclass as an object of its fields (in their order), a mapping
    as an object, a tuple as an array, an enum as its value, a path as a string."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if isinstance(value, pathlib.PurePath):
        return str(value)
    return value


def emit_json(value: Any) -> None:
    """Print ``value`` as one JSON document on stdout, and nothing else (never styled or cut)."""
    try:
        sys.stdout.write(json.dumps(plain(value), indent=2, ensure_ascii=False, default=str) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `tally status -o json | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# --------------------------------------------------------------------------- formatting


def age(at: float, now: float | None = None) -> str:
    """``at`` (epoch seconds) as a short age, e.g. ``"3m 12s ago"``; ``"-"`` when unset."""
    if at <= 0:
        return "-"
    seconds = max(0, int((time.time() if now is None else now) - at))
    if seconds < 60:
        text = f"{seconds}s"
    elif seconds < 3600:
        text = f"{seconds // 60}m {seconds % 60}s"
    elif seconds < 86400:
        text = f"{seconds // 3600}h {seconds % 3600 // 60}m"
    else:
        text = f"{seconds // 86400}d {seconds % 86400 // 3600}h"
    return f"{text} ago"


def clock(at: float, timespec: str = "seconds") -> str:
    """Epoch seconds as local ISO time (to the second, or ``timespec``); ``"-"`` when unset."""
    if at <= 0:
        return "-"
    return datetime.datetime.fromtimestamp(at).astimezone().isoformat(timespec=timespec)


def pairs(mapping: Mapping[str, Any]) -> str:
    """``k=v k=v`` in key order; nested values as compact JSON."""

    def text(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), default=str)

    return " ".join(f"{k}={text(v)}" for k, v in sorted(mapping.items()))


def duration(seconds: float) -> str:
    if seconds < 1:
        return "<1s"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60}m"


def writers_table(
    writers: Iterable[tally.WriterStatus],
    *,
    closed: bool = False,
    title: str | None = None,
    wide: bool = False,
) -> Table:
    """The writers as a table; ``wide`` adds their times in full and every count."""
    table = Table(title=title, title_justify="left")
    for name in ("writer", "host", "pid", "labels", "state", "opened", "heartbeat"):
        table.add_column(name)
    if closed or wide:
        table.add_column("closed")
    for name in ("pending", "applied", "completions"):
        table.add_column(name, justify="right")
    if wide:
        for name in ("skipped", "rewritten", "anomalies"):
            table.add_column(name, justify="right")
        for name in ("opened at", "last seen at", "closed at"):
            table.add_column(name)
    for w in writers:
        row = [w.writer_id, w.host, str(w.pid), pairs(w.labels), w.state, age(w.opened_at)]
        row.append(age(w.last_seen_at))
        if closed or wide:
            row.append(age(w.closed_at))
        row += [str(w.pending_sources), str(w.counts.applied), str(w.counts.completed)]
        if wide:
            row += [str(w.counts.skipped), str(w.counts.rewritten), str(w.counts.anomalies)]
            row += [clock(w.opened_at, "milliseconds"), clock(w.last_seen_at, "milliseconds")]
            row.append(clock(w.closed_at, "milliseconds"))
        table.add_row(*row)
    return table
