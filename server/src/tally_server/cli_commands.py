"""The operator commands of ``tally``: status, watch, writers, events, export, import, reset, inspect.

Every command but ``inspect`` talks to a running coordinator through the SDK (``tally.Client``),
exactly as any other client would; ``inspect`` reads a NeMo Curator folder offline. SDK errors
become one red line on stderr and exit code 1.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import lmdb
import typer
from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

import tally
from tally.integrations import nemo_format
from tally.integrations.nemo_format import FILE_SUFFIX, METADATA_DIRNAME

EXPORT_FILENAME = "tally-export.mdb"
# Window over which `tally watch` measures the completion rate.
_RATE_WINDOW_S = 60.0

out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)

Address = Annotated[
    str,
    typer.Option(
        "--address",
        envvar="TALLY_ADDRESS",
        help="Coordinator: host:port or grpc://, grpcs://, http://, https:// [TALLY_ADDRESS].",
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
DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 30.0


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


# --------------------------------------------------------------------------- status


def status(
    checkpoint: Annotated[str | None, typer.Argument(help="Checkpoint name; omit for all.")] = None,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Checkpoints at a glance, or one checkpoint in detail."""
    with connect(address, token, timeout) as client:
        if checkpoint is None:
            _status_all(client.checkpoints())
        else:
            _status_one(client.checkpoint(checkpoint))


def _status_all(checkpoints: list[tally.CheckpointStatus]) -> None:
    if not checkpoints:
        out.print("no checkpoints yet")
        return
    table = Table()
    table.add_column("checkpoint")
    for name in ("completed", "pending", "live writers", "anomalies", "unreadable files"):
        table.add_column(name, justify="right")
    table.add_column("last activity")
    for c in sorted(checkpoints, key=lambda c: c.name):
        table.add_row(
            c.name,
            str(c.completed_count),
            str(c.pending_sources),
            str(c.live_writers),
            _flag(c.anomalies),
            _flag(c.unreadable_files),
            age(c.last_activity_at),
        )
    out.print(table)


def _flag(count: int) -> Text:
    # Anomalies and unreadable files are the things an operator must not miss.
    return Text(str(count), style="bold red" if count else "")


def _status_one(c: tally.CheckpointStatus) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("checkpoint", c.name)
    grid.add_row("completed", str(c.completed_count))
    grid.add_row("pending", str(c.pending_sources))
    grid.add_row("settling", str(c.settling_sources))
    grid.add_row("live writers", str(c.live_writers))
    grid.add_row("anomalies", _flag(c.anomalies))
    grid.add_row("unreadable files", _flag(c.unreadable_files))
    grid.add_row("created", f"{clock(c.created_at)} ({age(c.created_at)})")
    grid.add_row("last activity", f"{clock(c.last_activity_at)} ({age(c.last_activity_at)})")
    grid.add_row("fingerprint", pairs(c.fingerprint) or "-")
    out.print(grid)
    if c.writers:
        out.print(writers_table(c.writers, title="live writers"))


# --------------------------------------------------------------------------- watch


@dataclass
class RateMeter:
    """Completions per second from successive snapshots, over a sliding window."""

    window_s: float = _RATE_WINDOW_S

    def __post_init__(self) -> None:
        self._points: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, at: float, completed: int) -> None:
        if self._points and completed < self._points[-1][1]:
            self._points.clear()  # the checkpoint was reset (or un-completed): start over
        self._points.append((at, completed))
        while len(self._points) > 2 and at - self._points[1][0] >= self.window_s:
            self._points.popleft()

    def rate(self) -> float | None:
        if len(self._points) < 2:
            return None
        (t0, c0), (t1, c1) = self._points[0], self._points[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None


def progress_line(s: tally.CheckpointStatus, rate: float | None) -> str:
    eta = "unknown"
    if s.pending_sources > 0 and rate is not None and rate > 0:
        eta = duration(s.pending_sources / rate)
    rate_text = "unknown" if rate is None else f"{rate:.2f}/s"
    return (
        f"{s.name}: completed {s.completed_count}  pending {s.pending_sources}  "
        f"live writers {s.live_writers}  anomalies {s.anomalies}  rate {rate_text}  ETA {eta}"
    )


def _progress_view(s: tally.CheckpointStatus, rate: float | None) -> Table:
    total = s.completed_count + s.pending_sources
    bar = ProgressBar(total=float(total or 1), completed=float(s.completed_count if total else 0), width=60)
    view = Table.grid()
    view.add_row(bar)
    view.add_row(Text(progress_line(s, rate)))
    return view


def watch(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    max_updates: Annotated[
        int | None, typer.Option("--max-updates", min=1, help="Exit after this many snapshots.")
    ] = None,
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="Seconds between updates.")] = 1.0,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Live progress of a checkpoint: completed, pending, rate and ETA."""
    meter = RateMeter()
    with connect(address, token, timeout) as client:
        if once:
            out.print(progress_line(client.checkpoint(checkpoint), None))
            return
        stream = client.watch(checkpoint, interval_s=interval)
        try:
            if out.is_terminal:
                with Live(console=out, auto_refresh=False) as live:
                    for n, snapshot in enumerate(stream, 1):
                        meter.add(time.monotonic(), snapshot.completed_count)
                        live.update(_progress_view(snapshot, meter.rate()), refresh=True)
                        if max_updates is not None and n >= max_updates:
                            break
            else:
                # Not a terminal (a log, a pipe): one line per snapshot instead of a redrawn bar.
                for n, snapshot in enumerate(stream, 1):
                    meter.add(time.monotonic(), snapshot.completed_count)
                    out.print(progress_line(snapshot, meter.rate()))
                    if max_updates is not None and n >= max_updates:
                        break
        except KeyboardInterrupt:
            pass
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()


# --------------------------------------------------------------------------- writers, events


def writers(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    all_: Annotated[
        bool, typer.Option("--all", help="Also writers that closed, expired or were lost.")
    ] = False,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Most writers shown.")] = 100,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Writers of a checkpoint: host, pid, labels (SLURM ids), heartbeat age, counts."""
    with connect(address, token, timeout) as client:
        found = client.writers(checkpoint, include_closed=all_, limit=limit)
    if not found:
        out.print(f"no {'' if all_ else 'live '}writers in {checkpoint}")
        return
    out.print(writers_table(found, closed=all_))


def events(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    limit: Annotated[int, typer.Option("--limit", min=1, help="Most events shown.")] = 50,
    before: Annotated[
        int | None, typer.Option("--before", min=1, help="Only events older than this id (paging).")
    ] = None,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Events of a checkpoint, newest first: anomalies, unreadable files, writers, resets."""
    with connect(address, token, timeout) as client:
        page = client.events(checkpoint, limit=limit, before_id=before)
    if not page.events:
        out.print(f"no events in {checkpoint}")
        return
    table = Table()
    table.add_column("id", justify="right")
    for name in ("time", "kind", "writer", "message", "data"):
        table.add_column(name)
    for e in page.events:
        style = "red" if e.kind in ("anomaly", "unreadable_file") else ""
        table.add_row(
            str(e.id), clock(e.at), Text(e.kind, style=style), e.writer_id or "-", e.message, pairs(e.data)
        )
    out.print(table)
    if page.next_before_id is not None:
        out.print(f"older events: tally events {checkpoint} --before {page.next_before_id}")


# --------------------------------------------------------------------------- NeMo folders


@dataclass
class MdbFile:
    path: Path
    sources: set[str]
    error: str | None = None


def metadata_dir(folder: Path) -> Path:
    """The ``.nemo_curator_metadata`` folder of ``folder``, or ``folder`` itself if it is one."""
    if folder.name == METADATA_DIRNAME and folder.is_dir():
        return folder
    return folder / METADATA_DIRNAME


def read_folder(folder: Path) -> list[MdbFile]:
    """Every ``*.mdb`` of a NeMo-format folder; unreadable ones carry their error.

    Read as the coordinator reads them: a damaged file, a link or anything else that is not a
    regular file is unreadable (never counted), and only a file without the completions database
    counts as empty.
    """
    meta = metadata_dir(folder)
    if not meta.is_dir():
        raise fail(f"{folder} is not a NeMo Curator checkpoint folder: {meta} does not exist")
    files = []
    for path in sorted(meta.glob(f"*{FILE_SUFFIX}")):
        try:
            files.append(MdbFile(path, nemo_format.read_file(path)))
        except nemo_format.READ_ERRORS as exc:
            files.append(MdbFile(path, set(), nemo_format.describe_error(exc, path)))
    return files


def inspect(
    folder: Annotated[
        Path, typer.Argument(help="A NeMo Curator checkpoint folder (or its metadata folder).")
    ],
) -> None:
    """Offline: completed count, per-file counts and unreadable files of a NeMo-format folder."""
    files = read_folder(folder)
    readable = [f for f in files if f.error is None]
    completed = set().union(*(f.sources for f in readable))
    table = Table()
    table.add_column("file")
    table.add_column("sources", justify="right")
    table.add_column("status")
    for f in files:
        state = Text("ok") if f.error is None else Text(f"unreadable: {f.error}", style="red")
        table.add_row(f.path.name, "-" if f.error else str(len(f.sources)), state)
    out.print(f"folder: {metadata_dir(folder)}")
    out.print(f"completed sources: {len(completed)} (union of {len(readable)} readable files)")
    out.print(f"files: {len(files)}, unreadable: {len(files) - len(readable)}")
    if files:
        out.print(table)


def import_(
    folder: Annotated[Path, typer.Argument(help="A folder NeMo Curator wrote (checkpoint_path).")],
    checkpoint: Annotated[str, typer.Option("--as", help="Checkpoint to import into.")],
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Adopt the completed sources of a NeMo Curator folder into a checkpoint."""
    files = read_folder(folder)
    ids: set[str] = set()
    for f in files:
        if f.error is not None:
            warn(f"skipping unreadable {f.path}: {f.error}")
        else:
            ids |= f.sources
    if not any(f.error is None for f in files):
        raise fail(f"no readable *.mdb files in {metadata_dir(folder)}; nothing to import")
    import_id = f"imported-{int(time.time())}"
    with connect(address, token, timeout) as client:
        result = client.import_completed(checkpoint, sorted(ids), import_id=import_id)
    out.print(
        f"imported {result.imported} new of {len(ids)} completed sources into {checkpoint} "
        f"(file {import_id}.mdb); completed count now {result.completed_count}"
    )


def export(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    folder: Annotated[Path, typer.Argument(help="Folder to write; NeMo Curator resumes from it.")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier export.")] = False,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Write a checkpoint's completed set as a folder that plain NeMo Curator resumes from."""
    meta = metadata_dir(folder)
    target = meta / EXPORT_FILENAME
    if target.exists() and not overwrite:
        raise fail(f"{target} exists; pass --overwrite to replace it")
    with connect(address, token, timeout) as client:
        client.checkpoint(checkpoint)  # an unknown checkpoint is refused before anything is created
        meta.mkdir(parents=True, exist_ok=True)
        try:
            # Built aside and renamed into place: a failed export never leaves a half-written file.
            count = nemo_format.create_file(target, client.completed(checkpoint), replace=True)
        except (lmdb.Error, OSError) as exc:
            raise fail(f"cannot write {target}: {nemo_format.describe_error(exc, target)}") from None
    out.print(f"exported {count} completed sources of {checkpoint} to {target}")


# --------------------------------------------------------------------------- reset


def reset(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    force: Annotated[bool, typer.Option("--force", help="Close live writers instead of refusing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Start a checkpoint over; its files move to the server's trash folder, never deleted."""
    with connect(address, token, timeout) as client:
        current = client.checkpoint(checkpoint)
        if not yes:
            closing = (
                f" and close its {current.live_writers} live writers"
                if force and current.live_writers
                else ""
            )
            question = (
                f"Reset {checkpoint}: forget its {current.completed_count} completed sources{closing}? "
                "(the files move to the server's trash folder)"
            )
            if not typer.confirm(question, default=False):
                raise fail("reset cancelled")
        try:
            result = client.reset(checkpoint, force=force)
        except tally.FailedPrecondition as exc:
            hint = "" if force else " (tally reset --force closes them)"
            raise fail(exc.message + hint) from None
    out.print(
        f"reset {checkpoint}: moved {result.files_moved} files to {result.moved_to or '(nothing to move)'} "
        f"in the server's data directory; closed {result.writers_closed} live writers"
    )


def register(app: typer.Typer) -> None:
    """Add the operator commands to the ``tally`` command."""
    app.command()(status)
    app.command()(watch)
    app.command()(writers)
    app.command()(events)
    app.command()(export)
    app.command(name="import")(import_)
    app.command()(reset)
    app.command()(inspect)
