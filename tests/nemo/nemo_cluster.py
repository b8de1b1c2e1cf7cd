"""What the real-NeMo tests share: ``.venv-nemo``, a private Ray head, a driver process, timings.

``ray_head`` starts a Ray head of its own (private ``HOME``, temp dir and loopback ports, no inherited
``RAY_*`` setting) in the foreground (``--block``) and ends exactly that cluster; every process it
starts carries a marker variable, by which teardown finds the stragglers.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.conftest import free_ports

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV = REPO / ".venv-nemo"
STAMP = VENV / ".installed-nemo-curator-1.4.0"
NEMO_PYTHON = VENV / "bin" / "python"
RUN_TIMEOUT_S = 300.0
# The variable every process of a test's Ray cluster inherits; its value is the cluster's temp dir.
MARKER = "TALLY_NEMO_TEST_RAY"
# The `ray start` of test_nemo_curator_real.py (ray_head adds the private part).
DEFAULT_START = (str(VENV / "bin" / "ray"), "start", "--head", "--num-cpus=8", "--include-dashboard=true")

# Seconds per step of the running test, printed after it (tests/nemo/conftest.py).
TIMINGS: dict[str, float] = {}


def require_env() -> None:
    """Skip without ``.venv-nemo`` (fail under CI, which must run these tests)."""
    if NEMO_PYTHON.exists() and STAMP.exists():
        return
    reason = f"{VENV.name}/ is not set up: run tests/nemo/setup_env.sh (or TALLY_NEMO_TESTS=1 ./dev test)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the NeMo Curator test, but {reason}")
    pytest.skip(reason)


def pids_with_env(marker: str) -> list[int]:
    """Processes whose environment holds ``marker``: everything our Ray head started."""
    pids = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return pids


def kill_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


# What a driver prints when the head wants a token it does not have: no retry will help.
_REFUSED = re.compile(r"InvalidAuthToken|AuthenticationError|UNAUTHENTICATED")


def private_env(temp_dir: str, *, limit_variable: bool = True) -> dict[str, str]:
    """The environment of every process of the test's cluster, free of the user's Ray settings.

    Ray reads them from the environment (``RAY_ADDRESS``, ``RAY_AUTH_*``, any ``RAY_<config>``) and
    from the home directory: Ray 2.60 turns token authentication on for a head when
    ``~/.ray/auth_token`` exists, and then refuses a driver that has no token. So no ``RAY_*``
    variable is inherited, HOME and the temp dir are the cluster's own, and authentication is off
    (a throwaway cluster on loopback ports). ``RAY_MAX_LIMIT_FROM_API_SERVER=40000`` is what
    docs/nemo-curator.md tells users to give the head; without it (``limit_variable=False``) the
    drop-in refuses the cluster.
    """
    home = Path(temp_dir) / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "VIRTUAL_ENV"}
    env.update(
        HOME=str(home),
        TMPDIR=temp_dir,
        RAY_TMPDIR=temp_dir,
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        # This checkout's SDK first: .venv-nemo's editable install may point at another checkout.
        PYTHONPATH=os.pathsep.join([str(HERE), str(REPO / "client" / "src")]),
        PYTHONUNBUFFERED="1",
    )
    if limit_variable:
        env.update(RAY_MAX_LIMIT_FROM_API_SERVER="40000", RAY_MAX_LIMIT_FROM_DATA_SOURCE="40000")
    return env


@contextlib.contextmanager
def ray_head(
    *,
    limit_variable: bool = True,
    start: Sequence[str] = DEFAULT_START,
    start_env: Mapping[str, str] | None = None,
) -> Iterator[dict[str, str]]:
    """A private Ray head; yields the environment of a driver that joins it (``RAY_ADDRESS`` set).

    ``start`` is the ``ray start --head ...`` command line (its program looked up on the ``PATH`` of
    the environment); ``ray_head`` adds ``--block``, ``--node-ip-address=127.0.0.1``, its temp dir
    and free loopback ports. ``start_env``: variables for the head's environment only (as in
    ``VAR=value ray start ...``). The output of ``ray start`` is in ``<temp dir>/ray-start.log``, the
    temp dir being the driver environment's ``TALLY_NEMO_TEST_RAY``.
    """
    require_env()
    # Ray's unix sockets live under the temp dir and must stay under ~107 bytes: keep it short.
    temp_dir = tempfile.mkdtemp(prefix="tray-", dir="/tmp")
    gcs, dashboard, client, node, objects, agent, agent_grpc, metrics, runtime_env = free_ports(9)
    # Every process of this cluster inherits the marker; teardown finds the stragglers by it.
    marker = f"{MARKER}={temp_dir}"
    env = {
        **private_env(temp_dir, limit_variable=limit_variable),
        MARKER: temp_dir,
        "RAY_ADDRESS": f"127.0.0.1:{gcs}",
    }
    log = open(Path(temp_dir) / "ray-start.log", "wb")  # noqa: SIM115 - closed in finally
    begin = time.monotonic()
    # --block keeps `ray start` in the foreground, in a session of its own: teardown ends exactly
    # this cluster (`ray stop` would stop every Ray cluster of this user on the machine).
    head = subprocess.Popen(
        [
            *start,
            "--block",
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            f"--port={gcs}",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={client}",
            f"--node-manager-port={node}",
            f"--object-manager-port={objects}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env}",
        ],
        env={**{k: v for k, v in env.items() if k != "RAY_ADDRESS"}, **(start_env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            probe = subprocess.run(
                [str(NEMO_PYTHON), "-c", "import ray; ray.init(); print(ray.cluster_resources()['CPU'])"],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if probe.returncode == 0:
                break
            refused = _REFUSED.search(probe.stderr)
            assert refused is None, (
                f"the test's private Ray head refuses its own driver ({refused and refused.group()}): "
                "some Ray setting of this machine still reaches the cluster (see private_env)\n"
                + probe.stderr[-3000:]
            )
            assert head.poll() is None, "ray start exited:\n" + (Path(temp_dir) / "ray-start.log").read_text()
            assert time.monotonic() < deadline, f"Ray head not reachable:\n{probe.stderr[-3000:]}"
            time.sleep(1)
        TIMINGS["ray start"] = time.monotonic() - begin
        yield env
    finally:
        stop = time.monotonic()
        kill_group(head, signal.SIGTERM)
        try:
            head.wait(timeout=3)  # a throwaway cluster: a short grace, then SIGKILL
        except subprocess.TimeoutExpired:
            kill_group(head, signal.SIGKILL)
            head.wait(timeout=30)
        # Workers of a killed driver outlive the head in sessions of their own (held FanOut tasks).
        for pid in pids_with_env(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        TIMINGS["ray stop"] = time.monotonic() - stop
        shutil.rmtree(temp_dir, ignore_errors=True)


class Driver:
    """One NeMo Curator driver process: ``.venv-nemo/bin/python SCRIPT ARGS`` (default nemo_driver.py)."""

    def __init__(
        self, env: dict[str, str], log: Path, args: list[str], script: Path = HERE / "nemo_driver.py"
    ) -> None:
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed by wait()/kill()
        self.process = subprocess.Popen(
            [str(NEMO_PYTHON), str(script), *args],
            env=env,
            cwd=script.parent,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def wait(self) -> None:
        try:
            code = self.process.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the pipeline did not finish in {RUN_TIMEOUT_S} s:\n{self.tail()}")
        self._log_file.close()
        assert code == 0, f"the pipeline failed ({code}):\n{self.tail()}"

    def kill(self) -> None:
        kill_group(self.process, signal.SIGKILL)
        self.process.wait(timeout=60)
        self._log_file.close()


def records(folder: Path) -> collections.Counter[str]:
    """The records of the ``*.jsonl`` files of ``folder`` (a JsonlWriter's output), each as sorted JSON."""
    rows: collections.Counter[str] = collections.Counter()
    for path in folder.glob("*.jsonl") if folder.exists() else []:
        rows.update(json.dumps(json.loads(line), sort_keys=True) for line in path.read_text().splitlines())
    return rows
