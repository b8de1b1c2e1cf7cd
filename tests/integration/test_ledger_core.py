"""The counting core a real ``tally serve`` runs: compiled by default, Python when told, alike in results.

``--ledger-core`` (``TALLY_LEDGER_CORE``): auto, compiled or python (domain/idmap.py). The compiled
core keeps the live writers' pending counts and dedup maps; whichever runs, the same deltas must
give the same counts, completions and unfinished sources.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tally
from tally_server.testing import RunningServer, running_server
from tests.conftest import compiled_core_required
from tests.integration.workload import tree


def core_of(server: RunningServer) -> str:
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    (info,) = [
        s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "tally_build_info"
    ]
    return info.labels["ledger_core"]


def drive(server: RunningServer) -> tuple[list[tuple[int, ...]], list[tuple[str, ...]], list[bool]]:
    """Deltas exercising every rule: new tasks, retries, rewrites, anomalies, sources left open."""
    counts, unfinished = [], []
    with tally.Client(server.grpc_address) as client:
        with client.writer("core/a", writer_id="first") as w:
            for n in range(300):  # batches of new tasks: the fast path
                w.apply_deltas(tree(f"s{n}"))
            w.apply_deltas(tree("s0")[:2])  # retried tasks of a completed source: skipped
            w.apply_deltas([("0_open", "open", 1), ("0_open", "open", 3)])  # a rewrite in one batch
            w.apply_deltas([("0_open_0", "open", 1), ("0_big", "big", 2**61), ("0_big_0", "big", 2**61)])
            w.flush()
        closed = w.close()
        counts.append(astuple(closed.counts))
        unfinished.append(tuple(sorted(closed.incomplete_sources)))
        with client.writer("core/a", writer_id="second") as w:
            w.apply_deltas([("0_s1_again", "s1", 1)])  # completed before it opened: an anomaly
            w.apply_deltas(tree("late") + [("0_s2", "s2", 1)])
            w.flush()
        closed = w.close()
        counts.append(astuple(closed.counts))
        unfinished.append(tuple(sorted(closed.incomplete_sources)))
        asked = ["s0", "s1", "s2", "s299", "late", "open", "big", "never"]
        answers = client.are_completed("core/a", asked)
    return counts, unfinished, answers


def astuple(counts: tally.ApplyCounts) -> tuple[int, ...]:
    return counts.applied, counts.skipped, counts.rewritten, counts.anomalies, counts.completed


def test_the_compiled_core_runs_by_default_and_the_python_core_counts_alike(tmp_path: Path) -> None:
    compiled_core_required()
    env = {k: v for k, v in os.environ.items() if k != "TALLY_LEDGER_CORE"}
    with running_server(tmp_path / "compiled", settle_ms=0, env=env) as server:
        assert core_of(server) == "compiled"
        compiled = drive(server)
        log = server.log_path.read_text()
    assert "compiled counting core" in log
    with running_server(tmp_path / "python", settle_ms=0, args=["--ledger-core", "python"]) as server:
        assert core_of(server) == "python"
        python = drive(server)
    assert compiled == python
    counts, unfinished, answers = compiled
    # What the rules say, so that "alike" is not alike and wrong: first writer 300 sources x 6
    # deltas + the rewrite's first delta + 3 new; 2 skipped; 1 rewrite; 300 completed.
    assert counts[0] == (300 * 6 + 4, 2, 1, 0, 300)
    assert counts[1] == (6, 0, 0, 2, 1)  # s1 and s2 were completed before it opened: anomalies
    assert unfinished == [("big", "open"), ()]  # an anomaly's delta is not counted
    assert answers == [True, False, False, True, True, False, False, False]  # anomalies un-complete


def test_asking_for_the_compiled_core_where_it_is_missing_is_one_line(tmp_path: Path) -> None:
    # The extension made unimportable in this process only (as on an installation built without a
    # C compiler); the real CLI, started the way the tally script starts it.
    start = (
        "import sys; sys.modules['tally_server._ledgercore'] = None; "
        "from tally.cli import main; sys.argv[0] = 'tally'; main()"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    command = [sys.executable, "-c", start, "serve", "--data-dir", str(tmp_path / "data")]
    refused = subprocess.run(
        [*command, "--ledger-core", "compiled"], capture_output=True, text=True, env=clean, timeout=60
    )
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        "tally serve: --ledger-core compiled is not valid: this installation lacks the compiled counting "
        "core (tally_server._ledgercore); reinstall tally-server where a C compiler and Python's headers "
        "are available, or use auto (the same rules in Python)"
    ]
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("value", ["fast", ""])
def test_an_unknown_core_is_refused(tmp_path: Path, value: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    tally_script = str(Path(sys.executable).parent / "tally")
    refused = subprocess.run(
        [tally_script, "serve", "--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        env={**clean, "TALLY_LEDGER_CORE": value},
        timeout=60,
    )
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"tally serve: TALLY_LEDGER_CORE={value} is not valid: input should be 'auto', 'compiled' or 'python'"
    ]
