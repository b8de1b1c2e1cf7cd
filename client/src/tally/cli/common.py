"""What every ``tally`` operator command shares: the consoles, the connection options, errors as
one red line, and the formatting of ages, times and labels."""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

import tally

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
            "comma-separated list [TALLY_ADDRESS]."
        ),
    ),
]
Token = Annotated[
    str | None, typer.Option("--token", envvar="TALLY_TOKEN", help="Bearer token [TALLY_TOKEN].")
]
Timeout = Annotated[
    float,
    typer.Option(
        "--timeout",
        envvar="TALLY_TIMEOUT",
        min=0.001,
        help="Seconds to wait for the coordinator [TALLY_TIMEOUT].",
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
    except ValueError as exc:  # an address the SDK cannot parse
        raise fail(str(exc)) from None
    try:
        with client:
            yield client
    except tally.TallyError as exc:
        raise fail(exc.message) from None


# --------------------------------------------------------------------------- formatting


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``count(1, "file")`` → ``"1 file"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


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


def clock(at: float) -> str:
    """Epoch seconds as local ISO time to the second; ``"-"`` when unset."""
    if at <= 0:
        return "-"
    return datetime.datetime.fromtimestamp(at).astimezone().isoformat(timespec="seconds")


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
    writers: Iterable[tally.WriterStatus], *, closed: bool = False, title: str | None = None
) -> Table:
    table = Table(title=title, title_justify="left")
    for name in ("writer", "host", "pid", "labels", "state", "opened", "heartbeat"):
        table.add_column(name)
    if closed:
        table.add_column("closed")
    for name in ("pending", "applied", "completions"):
        table.add_column(name, justify="right")
    for w in writers:
        row = [w.writer_id, w.host, str(w.pid), pairs(w.labels), w.state, age(w.opened_at)]
        row.append(age(w.last_seen_at))
        if closed:
            row.append(age(w.closed_at))
        row += [str(w.pending_sources), str(w.counts.applied), str(w.counts.completed)]
        table.add_row(*row)
    return table
