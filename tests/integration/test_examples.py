"""The runnable examples in examples/: crash midway, rerun, and compare with an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tally
from tally_server.testing import RunningServer

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = ["plain_python.py", "multiprocessing_pool.py"]
SOURCES = [f"part-{i:03d}.txt" for i in range(8)]


def run_example(script: str, server: RunningServer, *args: str) -> tuple[int, list[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TALLY_", "SLURM_"))}
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), "--address", server.grpc_address, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )
    processed = [
        line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("processed ")
    ]
    return result.returncode, processed, result.stdout + result.stderr


def outputs(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("script", EXAMPLES)
def test_a_crashed_run_resumes_with_exactly_the_rest(
    script: str, server: RunningServer, tmp_path: Path
) -> None:
    inputs = tmp_path / "in"
    common = ["--input", str(inputs)]
    rc, processed, log = run_example(
        script,
        server,
        "--checkpoint",
        "ex/full",
        *common,
        "--output",
        str(tmp_path / "full"),
        "--generate",
        "8",
    )
    assert rc == 0 and processed == SOURCES, log

    crash = ["--checkpoint", "ex/crash", *common, "--output", str(tmp_path / "resumed")]
    rc, first, log = run_example(script, server, *crash, "--fail-after", "3")
    assert rc == 3 and first == SOURCES[:3], log
    with tally.Client(server.grpc_address) as client:
        assert client.are_completed("ex/crash", SOURCES) == [True] * 3 + [False] * 5

    rc, rest, log = run_example(script, server, *crash)
    assert rc == 0 and "skipping 3 completed sources" in log, log
    assert rest == SOURCES[3:]
    assert outputs(tmp_path / "resumed") == outputs(tmp_path / "full") != {}

    rc, again, log = run_example(script, server, *crash)
    assert rc == 0 and again == [] and "skipping 8 completed sources" in log, log


def test_one_source_is_counted_in_the_singular(server: RunningServer, tmp_path: Path) -> None:
    """A crash after the first file and the rerun that skips it say "1 source", not "1 sources"."""
    run = ["--checkpoint", "ex/one", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    rc, first, log = run_example("plain_python.py", server, *run, "--generate", "3", "--fail-after", "1")
    assert rc == 3 and first == SOURCES[:1], log
    assert "crashing after 1 source" in log.splitlines(), log
    rc, rest, log = run_example("plain_python.py", server, *run)
    assert rc == 0 and rest == SOURCES[1:3], log
    assert "skipping 1 completed source" in log.splitlines(), log
    rc, _, log = run_example("plain_python.py", server, *run)
    assert rc == 0 and "skipping 3 completed sources" in log.splitlines(), log
