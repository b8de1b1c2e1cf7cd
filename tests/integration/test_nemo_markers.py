"""NeMo Curator's markers round-trip a folder: ``tally import`` says they are there and that the
coordinator does not keep them, ``tally export --markers-from`` copies them, byte for byte.

The markers are written here as NeMo Curator 1.4.0 writes them (``nemo_curator.backends.slurm_array``
and ``utils.retry_manifest``: compact sorted JSON and a newline, the completion file named by a hash
of the shard's identity); ``tests/nemo/`` checks that against the real NeMo Curator.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tally.cli.folders import marker_files
from tally.integrations import nemo_format
from tally_server.testing import RunningServer
from tests.integration.test_cli import ok, run
from tests.integration.workload import nemo_read

META = ".nemo_curator_metadata"


def _json(payload: dict[str, object]) -> bytes:
    return (json.dumps(payload, separators=(",", ":"), sort_keys=True) + "\n").encode()


def slurm_array_markers(total: int, completed: list[int], minimum: int = 0) -> dict[Path, bytes]:
    """What NeMo Curator's SLURM-array driver leaves in ``checkpoint_path/.nemo_curator_metadata``."""
    markers = {
        Path(".slurm_array_completion/run.json"): _json(
            {"minimum_shard_index": minimum, "total_shards": total}
        )
    }
    for shard in completed:
        identity = {"minimum_shard_index": minimum, "shard_index": shard, "total_shards": total}
        digest = hashlib.sha256(
            json.dumps(identity, separators=(",", ":"), sort_keys=True).encode()
        ).hexdigest()
        markers[Path(f".slurm_array_completion/completed_slurm_array_{digest[:16]}.json")] = _json(
            {**identity, "status": "completed"}
        )
    return markers


def write_folder(folder: Path, ids: set[str], markers: dict[Path, bytes]) -> None:
    (folder / META).mkdir(parents=True)
    nemo_format.create_file(folder / META / "host-1.mdb", ids)
    for rel, data in markers.items():
        (folder / META / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / META / rel).write_bytes(data)


def test_a_folder_with_slurm_array_markers_round_trips(server: RunningServer, tmp_path: Path) -> None:
    markers = {
        **slurm_array_markers(total=3, completed=[0, 2]),
        # Shard 1's attempt had a failed task: NeMo Curator's empty marker file, and no completion.
        Path(".failed_tasks/slurm_job_9/array_task_1/restart_0/shard_1/failed_tasks.json"): b"",
    }
    source = tmp_path / "nemo-run"
    write_folder(source, {"a", "b", "c"}, markers)
    (source / META / ".slurm_array_completion" / "linked.json").symlink_to(tmp_path / "elsewhere.json")
    address = server.grpc_address

    imported = ok("import", str(source), "--as", "nemo/markers", address=address)
    assert "imported 3 new of 3 completed sources" in imported
    assert (
        f"{source} also holds 4 NeMo Curator markers (.failed_tasks/slurm_job_9/array_task_1/restart_0/"
        "shard_1/failed_tasks.json, .slurm_array_completion/completed_slurm_array_"
    ) in imported
    assert f"`tally export nemo/markers FOLDER --markers-from {source}` copies them" in imported

    exported = tmp_path / "exported"
    out = ok("export", "nemo/markers", str(exported), "--markers-from", str(source), address=address)
    assert f"copied 4 NeMo Curator markers from {source} to {exported / META}" in out
    assert nemo_read(exported) == {"a", "b", "c"}
    # Byte for byte, at the same paths; the link is not followed.
    assert marker_files(exported) == marker_files(source) == markers
    assert sorted(p.name for p in (exported / META).iterdir()) == [
        ".failed_tasks",
        ".slurm_array_completion",
        "tally-export.mdb",
    ]

    # Again: nothing differs, nothing is copied.
    again = ok(
        "export", "nemo/markers", str(exported), "--overwrite", "--markers-from", str(source), address=address
    )
    assert "copied 0 NeMo Curator markers" in again and "(4 already there)" in again

    # Exporting into the folder the runs used: its markers are there already.
    same = ok("export", "nemo/markers", str(source), "--markers-from", str(source), address=address)
    assert "copied 0 NeMo Curator markers" in same and marker_files(source) == markers


def test_markers_of_another_run_are_not_overwritten_unless_asked(
    server: RunningServer, tmp_path: Path
) -> None:
    source = tmp_path / "run-of-3"
    write_folder(source, {"a"}, slurm_array_markers(total=3, completed=[1]))
    ok("import", str(source), "--as", "nemo/clash", address=server.grpc_address)
    target = tmp_path / "run-of-4"
    write_folder(target, set(), slurm_array_markers(total=4, completed=[]))
    refused = run(
        "export", "nemo/clash", str(target), "--markers-from", str(source), address=server.grpc_address
    )
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        f"error: {target / META / '.slurm_array_completion/run.json'} exists and differs from "
        f"{source / META / '.slurm_array_completion/run.json'} (markers of another run?); export to another "
        "folder, or pass --overwrite to replace it"
    )
    # Checked before anything was written.
    assert not (target / META / "tally-export.mdb").exists()
    assert marker_files(target) == slurm_array_markers(total=4, completed=[])

    ok(
        "export", "nemo/clash", str(target), "--overwrite", "--markers-from", str(source),
        address=server.grpc_address,
    )  # fmt: skip
    assert marker_files(target) == slurm_array_markers(total=3, completed=[1])
    assert nemo_read(target) == {"a"}


def test_a_markers_folder_that_is_not_there_is_refused(server: RunningServer, tmp_path: Path) -> None:
    ok("import", str(_folder_with(tmp_path / "run", {"a"})), "--as", "nemo/none", address=server.grpc_address)
    missing = run(
        "export", "nemo/none", str(tmp_path / "out"), "--markers-from", str(tmp_path / "typo"),
        address=server.grpc_address,
    )  # fmt: skip
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        f"error: --markers-from {tmp_path / 'typo'}: no such folder (give the checkpoint_path the runs used)"
    )
    assert not (tmp_path / "out").exists()
    # A folder without markers (a run without SLURM-array mode): a warning, and the export.
    plain = run(
        "export", "nemo/none", str(tmp_path / "out"), "--markers-from", str(tmp_path / "run"),
        address=server.grpc_address,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert f"warning: --markers-from {tmp_path / 'run'}: no NeMo Curator markers" in plain.stderr
    assert nemo_read(tmp_path / "out") == {"a"}


def _folder_with(folder: Path, ids: set[str]) -> Path:
    write_folder(folder, ids, {})
    return folder
