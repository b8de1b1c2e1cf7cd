"""deploy/slurm/worker.py as a SLURM array: N concurrent tasks, each a writer of one checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tally_server.testing import RunningServer

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "deploy" / "slurm" / "worker.py"
TALLY = str(Path(sys.executable).parent / "tally")
TASKS = 4
SOURCES = [f"file-{i:02d}.txt" for i in range(14)]  # shards of 4, 4, 3 and 3 files


def shard(index: int) -> list[str]:
    return SOURCES[index::TASKS]


def start_array(
    server: RunningServer, tmp_path: Path, array_job: str, *args: str, checkpoint: str = "slurm/run"
) -> dict[int, subprocess.Popen[str]]:
    """Start every task of the array at once (like SLURM)."""
    procs = {}
    for index in range(TASKS):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TALLY_", "SLURM_"))}
        env.update(
            TALLY_ADDRESS=server.grpc_address,
            SLURM_ARRAY_JOB_ID=array_job,
            SLURM_ARRAY_TASK_ID=str(index),
            SLURM_ARRAY_TASK_COUNT=str(TASKS),
            SLURM_JOB_ID=str(int(array_job) + 1 + index),
        )
        procs[index] = subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "--checkpoint",
                checkpoint,
                "--input",
                str(tmp_path / "in"),
                "--output",
                str(tmp_path / "out"),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
    return procs


def wait_array(procs: dict[int, subprocess.Popen[str]]) -> dict[int, tuple[int, list[str]]]:
    """Wait for every task; what each processed."""
    results = {}
    for index, proc in procs.items():
        out, _ = proc.communicate(timeout=90)
        processed = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("processed ")]
        results[index] = (proc.returncode, processed)
        assert proc.returncode in (0, 3), out
    return results


def run_array(
    server: RunningServer, tmp_path: Path, array_job: str, *args: str
) -> dict[int, tuple[int, list[str]]]:
    """Start every task of the array at once (like SLURM); wait for all; what each processed."""
    return wait_array(start_array(server, tmp_path, array_job, *args))


def tally_cli(server: RunningServer, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    env.update(COLUMNS="250", TALLY_TIMEOUT="10")
    result = subprocess.run(
        [TALLY, *args, "--address", server.grpc_address], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_rerun_of_a_killed_array_skips_what_any_task_finished(server: RunningServer, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    for i, name in enumerate(SOURCES):
        (tmp_path / "in" / name).write_text(
            "".join(f"line {j} of {name}\n" if j % 3 else "\n" for j in range(i % 4 + 2))
        )

    first = run_array(server, tmp_path, "100", "--fail-after", "2")
    for index in range(TASKS):
        assert first[index] == (3, shard(index)[:2])

    rerun = run_array(server, tmp_path, "200")
    for index in range(TASKS):
        assert rerun[index] == (0, shard(index)[2:])
    done = sorted(s for _, processed in [*first.values(), *rerun.values()] for s in processed)
    assert done == SOURCES  # each source processed exactly once over both runs

    # Outputs equal a single uninterrupted process over every file.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TALLY_", "SLURM_"))}
    subprocess.run(
        [
            sys.executable,
            str(WORKER),
            "--address",
            server.grpc_address,
            "--checkpoint",
            "slurm/once",
            "--input",
            str(tmp_path / "in"),
            "--output",
            str(tmp_path / "once"),
        ],
        check=True,
        capture_output=True,
        env=env,
        timeout=90,
    )
    out = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert out == {p.name: p.read_text() for p in (tmp_path / "once").iterdir()} != {}

    status = tally_cli(server, "status", "slurm/run")
    assert re.search(r"^completed\s{2,}14\s*$", status, re.MULTILINE), status
    writers = tally_cli(server, "writers", "slurm/run", "--all")
    labels = [line for line in writers.splitlines() if "slurm_array_job_id=" in line]
    assert len(labels) == 2 * TASKS, writers
    for job in ("100", "200"):
        for index in range(TASKS):
            tag = (
                f"slurm_array_job_id={job} slurm_array_task_count={TASKS} "
                f"slurm_array_task_id={index} slurm_job_id={int(job) + 1 + index}"
            )
            (line,) = [line for line in labels if tag in line]
            cells = [c.strip() for c in line.replace("┃", "│").strip().strip("│").split("│")]
            if job == "200":  # the rerun's tasks closed their writers (the killed ones did not)
                assert cells[4] == "closed", writers


def test_two_overlapping_arrays_on_one_checkpoint_process_each_source_once(
    server: RunningServer, tmp_path: Path
) -> None:
    """Two arrays of the same job started together (a resubmission while the first still runs):
    their tasks with the same index have the same shard and race for each file; claims split it."""
    (tmp_path / "in").mkdir()
    for name in SOURCES:
        (tmp_path / "in" / name).write_text(f"one line of {name}\n")
    first = start_array(server, tmp_path, "300", "--work-ms", "100", checkpoint="slurm/overlap")
    second = start_array(server, tmp_path, "400", "--work-ms", "100", checkpoint="slurm/overlap")
    results = [*wait_array(first).values(), *wait_array(second).values()]
    assert all(code == 0 for code, _ in results)
    done = sorted(s for _, processed in results for s in processed)
    assert done == SOURCES  # each source processed exactly once, by one array or the other
    status = tally_cli(server, "status", "slurm/overlap")
    assert re.search(r"^completed\s{2,}14\s*$", status, re.MULTILINE), status
