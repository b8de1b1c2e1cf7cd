"""Commands on NeMo Curator checkpoint folders: inspect (offline), import, export.

They read and write NeMo Curator 1.4.0's files through ``tally.integrations.nemo_format``, the one
implementation Tally has (the coordinator's store uses it too), so they need ``lmdb``, which the
``[cli]`` extra installs.

Besides its LMDB files (``.nemo_curator_metadata/*.mdb``), NeMo Curator keeps *markers* in
subfolders of ``.nemo_curator_metadata``: in SLURM-array mode its driver writes
``.slurm_array_completion/run.json`` (the array's ``total_shards`` and ``minimum_shard_index``) and
``completed_slurm_array_<hash>.json`` per shard whose run finished without a failed task (read by
``nemo_curator.backends.slurm_array.find_slurm_array_retries`` to list the shards to resubmit), and
``.failed_tasks/.../failed_tasks.json`` for an attempt with failed tasks. It writes them into
``checkpoint_path`` under Tally too. The coordinator does not keep them (they are files of the run's
folder, not completions): ``export --markers-from FOLDER`` copies them into an export, byte for
byte, and ``import`` says when a folder holds some.
"""

from __future__ import annotations

import os
import tempfile
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


def marker_files(folder: Path) -> dict[Path, bytes]:
    """NeMo Curator's markers in ``folder``: every regular file in a subfolder of its metadata folder,
    by path relative to that folder (e.g. ``.slurm_array_completion/run.json``), with its bytes.

    Links are not followed and not copied; a folder without a metadata folder has none.
    """
    meta = metadata_dir(folder)
    found: dict[Path, bytes] = {}
    if not meta.is_dir():
        return found
    for top in sorted(meta.iterdir()):
        if top.is_symlink() or not top.is_dir():
            continue  # the LMDB files (and Tally's temporary files) are the folder's top level
        for root, dirs, names in os.walk(top):  # followlinks=False: a linked folder is skipped
            dirs.sort()
            for name in sorted(names):
                path = Path(root, name)
                if path.is_file() and not path.is_symlink():
                    try:
                        found[path.relative_to(meta)] = path.read_bytes()
                    except OSError as exc:
                        raise fail(
                            f"cannot read NeMo Curator's marker {path}: {exc.strerror or exc}"
                        ) from None
    return found


def _marker_list(markers: dict[Path, bytes], most: int = 3) -> str:
    names = [str(p) for p in sorted(markers)]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _write_marker(path: Path, data: bytes) -> None:
    """Write through a temporary file and a rename, as NeMo Curator writes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


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
    markers = marker_files(folder)
    if markers:
        out.print(
            f"{folder} also holds {count(len(markers), 'NeMo Curator marker')} ({_marker_list(markers)}), "
            "which the coordinator does not keep: "
            f"`tally export {checkpoint} FOLDER --markers-from {folder}` copies them into an export"
        )


def export(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint name.")],
    folder: Annotated[Path, typer.Argument(help="Folder to write; NeMo Curator resumes from it.")],
    markers_from: Annotated[
        Path | None,
        typer.Option(
            "--markers-from",
            help="Also copy NeMo Curator's markers (SLURM-array run.json and completion manifests) "
            "from this folder: the checkpoint_path the runs used, or a folder you imported.",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an earlier export and markers that differ.")
    ] = False,
    address: Address = DEFAULT_ADDRESS,
    token: Token = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> None:
    """Write a checkpoint's completed set as a folder that plain NeMo Curator resumes from."""
    meta = metadata_dir(folder)
    target = meta / EXPORT_FILENAME
    if target.exists() and not overwrite:
        raise fail(f"{target} exists; pass --overwrite to replace it")
    copies, same = _markers_to_copy(markers_from, meta, overwrite) if markers_from else ({}, 0)
    with connect(address, token, timeout) as client:
        client.checkpoint(checkpoint)  # an unknown checkpoint is refused before anything is created
        meta.mkdir(parents=True, exist_ok=True)
        try:
            # Built aside and renamed into place: a failed export never leaves a half-written file.
            exported = nemo_format.create_file(target, client.completed(checkpoint), replace=True)
        except (lmdb.Error, OSError) as exc:
            raise fail(f"cannot write {target}: {nemo_format.describe_error(exc, target)}") from None
    out.print(f"exported {count(exported, 'completed source')} of {checkpoint} to {target}")
    if markers_from is None:
        return
    for rel, data in copies.items():
        try:
            _write_marker(meta / rel, data)
        except OSError as exc:
            raise fail(f"cannot write NeMo Curator's marker {meta / rel}: {exc.strerror or exc}") from None
    already = f" ({same} already there)" if same else ""
    out.print(f"copied {count(len(copies), 'NeMo Curator marker')} from {markers_from} to {meta}{already}")


def _markers_to_copy(source: Path, meta: Path, overwrite: bool) -> tuple[dict[Path, bytes], int]:
    """The markers of ``source`` that ``meta`` lacks or (with ``overwrite``) has otherwise, and how
    many it has already; checked before anything is written, so a refused export writes nothing."""
    if not source.is_dir():
        raise fail(f"--markers-from {source}: no such folder (give the checkpoint_path the runs used)")
    markers = marker_files(source)
    if not markers:
        warn(f"--markers-from {source}: no NeMo Curator markers in {metadata_dir(source)}; nothing to copy")
    copies: dict[Path, bytes] = {}
    same = 0
    for rel, data in markers.items():
        dest = meta / rel
        if dest.is_file() and not dest.is_symlink():
            if dest.read_bytes() == data:
                same += 1
                continue
            if not overwrite:
                raise fail(
                    f"{dest} exists and differs from {metadata_dir(source) / rel} (markers of another "
                    "run?); export to another folder, or pass --overwrite to replace it"
                )
        elif dest.exists() or dest.is_symlink():
            raise fail(f"{dest} is in the way of NeMo Curator's marker {rel}: it is not a regular file")
        copies[rel] = data
    return copies, same
