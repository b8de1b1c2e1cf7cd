"""The real NeMo Curator 1.4.0 against a real ``tally serve``, on a private local Ray head.

JsonlReader(files_per_partition=1) → FanOut (1→3) → DropSome (filter) → JsonlWriter, run by
``nemo_driver.py`` under ``.venv-nemo`` (built by ``tests/nemo/setup_env.sh``):

a. an uninterrupted reference run;
b. a run killed midway: FanOut lets ``PASS_LIMIT`` partitions through and holds the rest; once the
   coordinator reports those complete, the driver is SIGKILLed;
c. a rerun that must process exactly the partitions (b) did not complete, and whose output equals (a);
d. ``tally export``, then plain NeMo Curator without Tally resumes from the export and processes nothing;
e. a run during which the coordinator is killed (kill -9) and started again on the same ports: the
   pipeline carries on and finishes without noticing, with (a)'s output;
f. a rerun after (e) processes nothing.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tally
from tally.cli.folders import marker_files
from tally_server.testing import RunningServer, running_server
from tests.integration.test_nemo_markers import slurm_array_markers
from tests.nemo.nemo_cluster import (
    NEMO_PYTHON,
    RUN_TIMEOUT_S,
    STAMP,
    TIMINGS,
    Driver,
    ray_head,
    records,
    require_env,
)

TALLY_CLI = Path(sys.executable).parent / "tally"

FILES = [f"in-{i:02d}.jsonl" for i in range(6)]
RECORDS_PER_FILE = 4
PASS_LIMIT = 3  # partitions run (b) lets through before it is killed

pytestmark = [pytest.mark.nemo, pytest.mark.timeout(1500)]


@pytest.fixture
def ray_env() -> Iterator[dict[str, str]]:
    """A private Ray head (8 CPUs, dashboard on) on free loopback ports; the env to reach it."""
    with ray_head() as env:
        yield env


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[RunningServer]:
    with running_server(tmp_path / "tally-data") as srv:
        yield srv


def _write_inputs(folder: Path) -> None:
    folder.mkdir()
    for name in FILES:
        rows = [{"id": f"{name}-{r}", "text": f"record {r} of {name}"} for r in range(RECORDS_PER_FILE)]
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


def _run(env: dict[str, str], tmp: Path, label: str, *args: str) -> None:
    start = time.monotonic()
    Driver(env, tmp / f"{label}.log", list(args)).wait()
    TIMINGS[label] = time.monotonic() - start


def _seen(folder: Path) -> dict[str, str]:
    """Partitions FanOut saw: input file name → NeMo Curator source id."""
    if not folder.exists():
        return {}
    return {p.name: json.loads(p.read_text())["source_id"] for p in folder.iterdir()}


def test_kill_rerun_and_export_with_the_real_nemo_curator(
    tmp_path: Path, ray_env: dict[str, str], coordinator: RunningServer
) -> None:
    TIMINGS["env setup (when .venv-nemo was built)"] = float(STAMP.read_text().strip() or 0)
    address = f"grpc://{coordinator.grpc_address}"
    inputs = tmp_path / "in"
    _write_inputs(inputs)
    common = ["--input", str(inputs)]
    client = tally.Client(address)

    # (a) The reference: one uninterrupted run, as shard 0 of 1 of NeMo Curator's own SLURM-array
    # sharding (as a launcher sets it in the driver's environment, not the Ray head's).
    shard = {"NEMO_CURATOR_SLURM_ARRAY_SHARD_INDEX": "0", "NEMO_CURATOR_SLURM_ARRAY_TOTAL_SHARDS": "1"}
    _run(
        {**ray_env, **shard}, tmp_path, "run a (reference)", *common,
        "--output", str(tmp_path / "out-ref"),
        "--checkpoint-path", str(tmp_path / "unused-a"),
        "--seen-dir", str(tmp_path / "seen-a"),
        "--tally-address", address, "--tally-checkpoint", "nemo/reference",
    )  # fmt: skip
    source_ids = _seen(tmp_path / "seen-a")
    assert sorted(source_ids) == FILES
    ids = [source_ids[name] for name in FILES]
    assert client.are_completed("nemo/reference", ids) == [True] * len(FILES)
    # The drop-in declared the source stage's partitions: a total, nothing remaining.
    declared = client.checkpoint("nemo/reference")
    assert (declared.total, declared.remaining, declared.percent) == (len(FILES), 0, 100.0)
    reference = records(tmp_path / "out-ref")
    # 2 of 3 parts survive the filter, none of in-03's.
    assert sum(reference.values()) == (len(FILES) - 1) * 2 * RECORDS_PER_FILE
    # Under Tally, NeMo Curator writes its SLURM-array markers and nothing else to checkpoint_path
    # (no LMDB file: NeMo's own actor did not run), as docs/nemo-curator.md says.
    assert marker_files(tmp_path / "unused-a") == slurm_array_markers(total=1, completed=[0])
    assert not list((tmp_path / "unused-a" / ".nemo_curator_metadata").glob("*.mdb")), "NeMo's own actor ran"
    # The actor runs with the Ray worker's environment; the drop-in labelled its writer from the driver's.
    (writer,) = client.writers("nemo/reference", include_closed=True)
    assert writer.labels == {"nemo_curator_shard_index": "0", "nemo_curator_total_shards": "1"}

    # (b) Killed midway: PASS_LIMIT partitions pass FanOut, the others are held there.
    output = tmp_path / "out"
    gate = tmp_path / "gate"
    start = time.monotonic()
    driver = Driver(
        ray_env,
        tmp_path / "run b (killed).log",
        [
            *common,
            "--output", str(output),
            "--checkpoint-path", str(tmp_path / "unused-b"),
            "--seen-dir", str(tmp_path / "seen-b"),
            "--gate-dir", str(gate),
            "--pass-limit", str(PASS_LIMIT),
            "--tally-address", address, "--tally-checkpoint", "nemo/run",
        ],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            passed = {p.read_text() for p in gate.glob("slot-*")} if gate.exists() else set()
            if len(passed) == PASS_LIMIT and all(
                client.are_completed("nemo/run", [source_ids[n] for n in passed])
            ):
                break
            assert driver.process.poll() is None, f"run (b) ended before it was killed:\n{driver.tail()}"
            assert time.monotonic() < deadline, (
                f"run (b) did not complete {PASS_LIMIT} partitions:\n{driver.tail()}"
            )
            time.sleep(0.2)
    finally:
        driver.kill()
    TIMINGS["run b (killed midway)"] = time.monotonic() - start
    done_b = dict(zip(FILES, client.are_completed("nemo/run", ids), strict=True))
    assert {n for n, done in done_b.items() if done} == passed

    # (c) The rerun processes exactly what (b) left, and ends with (a)'s output.
    _run(
        ray_env, tmp_path, "run c (rerun)", *common,
        "--output", str(output),
        "--checkpoint-path", str(tmp_path / "unused-c"),
        "--seen-dir", str(tmp_path / "seen-c"),
        "--tally-address", address, "--tally-checkpoint", "nemo/run",
    )  # fmt: skip
    assert set(_seen(tmp_path / "seen-c")) == set(FILES) - passed
    assert client.are_completed("nemo/run", ids) == [True] * len(FILES)
    assert records(output) == reference

    # (d) Export, then plain NeMo Curator (no Tally) resumes from the folder and does nothing.
    exported = tmp_path / "exported"
    subprocess.run(
        [str(TALLY_CLI), "export", "--address", address, "nemo/run", str(exported)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert list((exported / ".nemo_curator_metadata").glob("*.mdb"))
    _run(
        ray_env, tmp_path, "run d (plain NeMo Curator from the export)", *common,
        "--output", str(tmp_path / "out-d"),
        "--checkpoint-path", str(exported),
        "--seen-dir", str(tmp_path / "seen-d"),
    )  # fmt: skip
    assert _seen(tmp_path / "seen-d") == {}
    assert records(tmp_path / "out-d") == collections.Counter()
    client.close()

    # (e) The coordinator dies mid-run (kill -9) and comes back on the same ports: the pipeline
    # carries on, its writer restored from the journal, and finishes with (a)'s output.
    output_e, gate_e = tmp_path / "out-e", tmp_path / "gate-e"
    start = time.monotonic()
    driver = Driver(
        ray_env,
        tmp_path / "run e (coordinator restarted).log",
        [
            *common,
            "--output", str(output_e),
            "--checkpoint-path", str(tmp_path / "unused-e"),
            "--seen-dir", str(tmp_path / "seen-e"),
            "--gate-dir", str(gate_e),
            "--pass-limit", str(PASS_LIMIT),
            "--tally-address", address, "--tally-checkpoint", "nemo/restart",
        ],
    )  # fmt: skip
    try:
        with tally.Client(address) as watcher:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while True:
                passed = {p.read_text() for p in gate_e.glob("slot-*")} if gate_e.exists() else set()
                held = len(list(gate_e.glob("held-*"))) if gate_e.exists() else 0
                if (
                    len(passed) == PASS_LIMIT
                    and held
                    and all(watcher.are_completed("nemo/restart", [source_ids[n] for n in passed]))
                ):
                    break
                assert driver.process.poll() is None, f"run (e) ended early:\n{driver.tail()}"
                assert time.monotonic() < deadline, f"run (e) did not get going:\n{driver.tail()}"
                time.sleep(0.2)
        ports = {"grpc_listen": coordinator.grpc_address, "http_listen": coordinator.http_address}
        coordinator.kill()
        with running_server(coordinator.data_dir, **ports) as again:  # type: ignore[arg-type]
            (gate_e / "open").touch()  # the held partitions go on
            driver.wait()
            TIMINGS["run e (coordinator killed and restarted)"] = time.monotonic() - start
            with tally.Client(f"grpc://{again.grpc_address}") as after:
                assert after.are_completed("nemo/restart", ids) == [True] * len(FILES)
                kinds = {e.kind for e in after.events("nemo/restart", limit=200).events}
                assert "writer_restored" in kinds and "writer_lost" not in kinds
            assert records(output_e) == reference

            # (f) Nothing is left to do.
            _run(
                ray_env, tmp_path, "run f (rerun after the restart)", *common,
                "--output", str(tmp_path / "out-f"),
                "--checkpoint-path", str(tmp_path / "unused-f"),
                "--seen-dir", str(tmp_path / "seen-f"),
                "--tally-address", f"grpc://{again.grpc_address}", "--tally-checkpoint", "nemo/restart",
            )  # fmt: skip
            assert _seen(tmp_path / "seen-f") == {}
    finally:
        if driver.process.poll() is None:
            driver.kill()


def test_a_ray_head_started_without_the_limit_variable_is_refused_in_one_line(tmp_path: Path) -> None:
    """NeMo Curator's XennaExecutor would fail inside the run; the drop-in refuses the cluster at once."""
    code = (
        "import nemo_curator\n"  # sets RAY_MAX_LIMIT_FROM_API_SERVER in the driver, not in the head
        "from tally.integrations.nemo_curator import tally_for_nemo_curator\n"
        "with tally_for_nemo_curator('nemo/limit', address='grpc://127.0.0.1:9'):\n"
        "    print('the block ran')\n"
    )
    with ray_head(limit_variable=False) as env:
        start = time.monotonic()
        result = subprocess.run(
            [str(NEMO_PYTHON), "-c", code], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        TIMINGS["refused driver"] = time.monotonic() - start
    assert result.returncode == 1 and "the block ran" not in result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        "RuntimeError: the Ray head's API server answers state queries of at most 10000 entries and "
        "NeMo Curator's XennaExecutor asks for 40000: restart the Ray head with "
        "RAY_MAX_LIMIT_FROM_API_SERVER=40000 in its environment (e.g. `RAY_MAX_LIMIT_FROM_API_SERVER=40000 "
        "ray start --head ...`; NeMo Curator's RayClient sets it), or pass check_ray_limit=False with "
        "another executor"
    )


def test_the_markers_tally_carries_are_the_ones_nemo_curator_writes(tmp_path: Path) -> None:
    """NeMo Curator's own code writes a SLURM array's markers (shards 0 and 2 of 3 completed) and
    reads back which shards to resubmit, from its folder and from a ``tally export --markers-from``."""
    require_env()
    folder = tmp_path / "checkpoint"
    code = (
        "import sys\n"
        "from nemo_curator.backends.slurm_array import build_slurm_array_completion_manifest as build\n"
        "for shard in (0, 2):\n"
        "    build(sys.argv[1], shard_index=shard, total_shards=3, minimum_shard_index=0).mark_completed()\n"
    )
    subprocess.run([str(NEMO_PYTHON), "-c", code, str(folder)], check=True, capture_output=True, timeout=120)
    assert marker_files(folder) == slurm_array_markers(total=3, completed=[0, 2])
    with running_server(tmp_path / "tally-data") as srv:
        with tally.Client(srv.grpc_address) as client:
            client.import_completed("nemo/markers", ["a"], import_id="seed")
        subprocess.run(
            [str(TALLY_CLI), "export", "--address", srv.grpc_address, "--markers-from", str(folder),
             "nemo/markers", str(tmp_path / "exported")],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    retries = (
        "import sys\n"
        "from nemo_curator.backends.slurm_array import find_slurm_array_retries\n"
        "print(find_slurm_array_retries(sys.argv[1]).shard_indices)\n"
    )
    for where in (folder, tmp_path / "exported"):
        answer = subprocess.run(
            [str(NEMO_PYTHON), "-c", retries, str(where)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert answer.stdout.strip() == "(1,)", where


@pytest.mark.postgres
def test_nemo_curator_through_replicas_of_a_postgresql_store(
    tmp_path: Path, ray_env: dict[str, str], postgres_url: str
) -> None:
    """The pipeline reaches the coordinator through a replica of a PostgreSQL store (the owner listed
    second). Killed midway; the owner is then killed -9 and the replica takes the store over; the
    rerun processes exactly what was left; an export from the PostgreSQL store lets plain NeMo Curator
    resume with nothing to do."""
    inputs = tmp_path / "in"
    _write_inputs(inputs)
    common = ["--input", str(inputs)]
    with (
        running_server(tmp_path / "owner", store=postgres_url) as owner,
        running_server(tmp_path / "replica", store=postgres_url) as replica,
    ):
        assert "serving as a replica" in replica.log()
        address = f"grpc://{replica.grpc_address},grpc://{owner.grpc_address}"
        output, gate = tmp_path / "out", tmp_path / "gate"
        driver = Driver(
            ray_env,
            tmp_path / "run pg-b (killed).log",
            [
                *common,
                "--output", str(output),
                "--checkpoint-path", str(tmp_path / "unused-b"),
                "--seen-dir", str(tmp_path / "seen-b"),
                "--gate-dir", str(gate),
                "--pass-limit", str(PASS_LIMIT),
                "--tally-address", address, "--tally-checkpoint", "nemo/pg",
            ],
        )  # fmt: skip
        with tally.Client(f"grpc://{replica.grpc_address}") as client:
            try:
                deadline = time.monotonic() + RUN_TIMEOUT_S
                while True:
                    passed = {p.read_text() for p in gate.glob("slot-*")} if gate.exists() else set()
                    source_ids = _seen(tmp_path / "seen-b")
                    if len(passed) == PASS_LIMIT and all(
                        client.are_completed("nemo/pg", [source_ids[n] for n in passed])
                    ):
                        break
                    assert driver.process.poll() is None, f"run ended before it was killed:\n{driver.tail()}"
                    assert time.monotonic() < deadline, f"run did not complete {PASS_LIMIT}:\n{driver.tail()}"
                    time.sleep(0.2)
            finally:
                driver.kill()
        owner.kill()  # the replica takes the store over, on its own ports
        _run(
            ray_env, tmp_path, "run pg-c (rerun through the replica that took over)", *common,
            "--output", str(output),
            "--checkpoint-path", str(tmp_path / "unused-c"),
            "--seen-dir", str(tmp_path / "seen-c"),
            "--tally-address", address, "--tally-checkpoint", "nemo/pg",
        )  # fmt: skip
        assert "taking over store" in replica.log()
        assert set(_seen(tmp_path / "seen-c")) == set(FILES) - passed
        source_ids = {**_seen(tmp_path / "seen-b"), **_seen(tmp_path / "seen-c")}
        assert sorted(source_ids) == FILES
        ids = [source_ids[name] for name in FILES]
        # 2 of 3 parts survive the filter, none of in-03's: what one uninterrupted run writes.
        assert sum(records(output).values()) == (len(FILES) - 1) * 2 * RECORDS_PER_FILE
        with tally.Client(f"grpc://{replica.grpc_address}") as client:
            assert client.are_completed("nemo/pg", ids) == [True] * len(FILES)
        exported = tmp_path / "exported"
        subprocess.run(
            [str(TALLY_CLI), "export", "--address", replica.grpc_address, "nemo/pg", str(exported)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    _run(
        ray_env, tmp_path, "run pg-d (plain NeMo Curator from the export)", *common,
        "--output", str(tmp_path / "out-d"),
        "--checkpoint-path", str(exported),
        "--seen-dir", str(tmp_path / "seen-d"),
    )  # fmt: skip
    assert _seen(tmp_path / "seen-d") == {}
    assert records(tmp_path / "out-d") == collections.Counter()
