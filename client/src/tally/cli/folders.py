"""Commands on NeMo Curator checkpoint folders: inspect (offline), import, export.

They read and write NeMo Curator 1.4.0's files through ``tally.integrations.nemo_format``, the one
implementation Tally has (the coordinator's store uses it too), so they need ``lmdb``, which the
``[cli]`` extra installs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import lmdb
import typer
from rich.table import Table
from rich.text import Text

from tally._config import DEFAULT_ADDRESS, DEFAULT_TIMEOUT
from tally.cli.common import (
    Address,
    Output,
    OutputFormat,
    Timeout,
    Token,
    connect,
    count,
    emit_json,
    fail,
    out,
    warn,
)
from tally.integrations import nemo_format
from tally.integrations.nemo_format import FILE_SUFFIX, METADATA_DIRNAME

EXPORT_FILENAME = "tally-export.mdb"


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
    output: OutputFormat = Output.TABLE,
) -> None:
    """Offline: completed count, per-file counts and unreadable files of a NeMo-format folder.

    -o json: one object: folder, completed_sources, files (path, sources, error: null when readable);
    -o wide shows each file's full path.
    """
    files = read_folder(folder)
    readable = [f for f in files if f.error is None]
    completed = set().union(*(f.sources for f in readable))
    if output == Output.JSON:
        listed = [
            {"path": str(f.path), "sources": None if f.error else len(f.sources), "error": f.error}
            for f in files
        ]
        emit_json({"folder": str(metadata_dir(folder)), "completed_sources": len(completed), "files": listed})
        return
    table = Table()
    table.add_column("file")
    table.add_column("sources", justify="right")
    table.add_column("status")
    for f in files:
        state = Text("ok") if f.error is None else Text(f"unreadable: {f.error}", style="red")
        name = str(f.path) if output == Output.WIDE else f.path.name
        table.add_row(name, "-" if f.error else str(len(f.sources)), state)
    out.print(f"folder: {metadata_dir(folder)}")
    out.print(f"completed sources: {len(completed)} (union of {count(len(readable), 'readable file')})")
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
    if result.imported:
        written = f"file {import_id}.mdb"
    elif ids:
        written = "nothing written: every one was completed there already"
    else:
        written = "nothing written: the folder's files list no completed source"
    out.print(
        f"imported {result.imported} new of {count(len(ids), 'completed source')} into {checkpoint} "
        f"({written}); completed count now {result.completed_count}"
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
            exported = nemo_format.create_file(target, client.completed(checkpoint), replace=True)
        except (lmdb.Error, OSError) as exc:
            raise fail(f"cannot write {target}: {nemo_format.describe_error(exc, target)}") from None
    out.print(f"exported {count(exported, 'completed source')} of {checkpoint} to {target}")
