"""What entering ``tally_for_nemo_curator`` costs, side by side with NeMo Curator's own actor start.

    .venv/bin/python bench/nemo_enter.py [--rounds N] [--nemo-venv PATH]

``Pipeline.run(checkpoint_path=...)`` of NeMo Curator 1.4.0 starts its resumability actor itself
(``with ray.init(): create_resumability_actor(path)``, which blocks until the actor answers). Under
the drop-in, the ``with`` block creates Tally's proxy actor first and ``Pipeline.run`` then adopts it
(``get_if_exists=True``). So the cost to compare is, per run:

- **NeMo alone**: ``with ray.init(): create_resumability_actor(...)``;
- **with Tally**: entering the drop-in, plus the same NeMo call, which now adopts the proxy.

Both run against one private Ray head (``ray start --head``, 8 CPUs, as a user's cluster) and one
``tally serve`` of this checkout, interleaved A B A B, and each prints its median, its range and the
1-minute load beside it. The drop-in's phases (connect, create the actor and wait for its writer,
disconnect) are timed by wrapping ``ray.init``, ``ray.get`` and ``ray.shutdown``.

The driver runs under ``.venv-nemo`` (``tests/nemo/setup_env.sh``) with this checkout's SDK first on
``PYTHONPATH``; this process only starts the Ray head and the server and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def _load() -> float:
    return os.getloadavg()[0]


# ----------------------------------------------------------------------- the driver, in .venv-nemo


def _timed(record: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record[name] = record.get(name, 0.0) + time.perf_counter() - start

    return wrapper


def driver(ray_address: str, tally_address: str, rounds: int) -> Iterator[dict[str, Any]]:
    import ray
    from nemo_curator.utils.resumability_actor import create_resumability_actor, shutdown_resumability_actor

    from tally.integrations.nemo_curator import tally_for_nemo_curator

    def nemo_start(folder: str) -> float:
        start = time.perf_counter()
        with ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False):
            create_resumability_actor(folder)
        return time.perf_counter() - start

    def nemo_stop() -> None:
        with ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False):
            shutdown_resumability_actor()

    originals = ray.init, ray.get, ray.shutdown
    for r in range(rounds):
        with tempfile.TemporaryDirectory() as folder:
            load = _load()
            alone = nemo_start(folder)
            nemo_stop()
            yield {"side": "nemo", "round": r, "seconds": alone, "load": load}
        with tempfile.TemporaryDirectory() as folder:
            phases: dict[str, float] = {}
            load = _load()
            ray.init = _timed(phases, "connect", originals[0])
            ray.get = _timed(phases, "create actor + open writer", originals[1])
            ray.shutdown = _timed(phases, "disconnect", originals[2])
            start = time.perf_counter()
            try:
                block = tally_for_nemo_curator(f"bench-enter/r{r}", tally_address, ray_address=ray_address)
                block.__enter__()
            finally:
                ray.init, ray.get, ray.shutdown = originals
            entered = time.perf_counter() - start
            adopted = nemo_start(folder)
            nemo_stop()
            start = time.perf_counter()
            block.__exit__(None, None, None)
            left = time.perf_counter() - start
            phases["other"] = entered - sum(phases.values())
            yield {
                "side": "tally",
                "round": r,
                "seconds": entered + adopted,
                "enter": entered,
                "adopt": adopted,
                "exit": left,
                "phases": phases,
                "load": load,
            }


# ------------------------------------------------------------------------------- the orchestrator


def _private_env(temp_dir: Path) -> dict[str, str]:
    """compare.py's anchor environment (no user Ray settings), with this checkout's SDK importable."""
    from compare import _private_env as anchor_env

    env = anchor_env(temp_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH), str(ROOT / "client" / "src")])
    # NeMo Curator's Xenna executor lists up to 40,000 entries; the drop-in checks the head allows it.
    env["RAY_MAX_LIMIT_FROM_API_SERVER"] = env["RAY_MAX_LIMIT_FROM_DATA_SOURCE"] = "40000"
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}–{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nemo-venv", type=Path, default=ROOT / ".venv-nemo")
    parser.add_argument("--driver", nargs=2, metavar=("RAY", "TALLY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.driver:
        for row in driver(*args.driver, args.rounds):
            print(json.dumps(row), flush=True)
        return 0

    from tally_server.testing import running_server

    python = args.nemo_venv / "bin" / "python"
    if not python.exists():
        print(
            f"error: no NeMo Curator venv at {args.nemo_venv}: run tests/nemo/setup_env.sh", file=sys.stderr
        )
        return 2
    temp_dir = Path(tempfile.mkdtemp(prefix="tben-", dir="/tmp"))
    env = _private_env(temp_dir)
    print(f"a private Ray head in {temp_dir}", file=sys.stderr)
    gcs = _free_port()
    head = subprocess.Popen(
        [
            str(args.nemo_venv / "bin" / "ray"),
            "start",
            "--head",
            "--block",
            "--num-cpus=8",
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            f"--port={gcs}",
            f"--dashboard-port={_free_port()}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    rows: list[dict[str, Any]] = []
    try:
        with running_server(temp_dir / "tally") as server:
            address = f"127.0.0.1:{gcs}"
            probe = [str(python), "-c", f"import ray; ray.init(address='{address}'); ray.shutdown()"]
            deadline = time.monotonic() + 120
            while subprocess.run(probe, env=env, capture_output=True).returncode != 0:
                if head.poll() is not None or time.monotonic() > deadline:
                    print("error: the private Ray head did not start", file=sys.stderr)
                    return 1
                time.sleep(1)
            command = [str(python), str(Path(__file__)), "--rounds", str(args.rounds), "--driver"]
            out = subprocess.run(
                [*command, address, server.grpc_address], env=env, capture_output=True, text=True, check=False
            )
            if out.returncode != 0:
                print(out.stderr[-4000:], file=sys.stderr)
                return 1
            rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        from compare import _pids_with_env

        for pid in _pids_with_env(f"TALLY_BENCH_RAY={temp_dir}"):  # workers in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)

    nemo = [r for r in rows if r["side"] == "nemo"]
    tally = [r for r in rows if r["side"] == "tally"]

    def load(side: list[dict[str, Any]]) -> str:
        loads = [r["load"] for r in side]
        return f"{min(loads):.1f}–{max(loads):.1f}"

    print(f"## Starting a checkpointed NeMo Curator run: {args.rounds} rounds, interleaved\n")
    print(f"| what | median (range) | load (1 min, {os.cpu_count()} CPUs) |")
    print("|---|---|---|")
    print(f"| NeMo alone: its own actor start | {_cell([r['seconds'] for r in nemo])} | {load(nemo)} |")
    print(f"| with Tally: enter + NeMo adopts | {_cell([r['seconds'] for r in tally])} | {load(tally)} |")
    print(f"|   entering the drop-in | {_cell([r['enter'] for r in tally])} | |")
    for phase in tally[0]["phases"]:
        print(f"|     {phase} | {_cell([r['phases'][phase] for r in tally])} | |")
    print(f"|   NeMo adopting the proxy | {_cell([r['adopt'] for r in tally])} | |")
    print(f"|   leaving the drop-in | {_cell([r['exit'] for r in tally])} | |")
    ratio = statistics.median(r["seconds"] for r in tally) / statistics.median(r["seconds"] for r in nemo)
    print(f"\nwith Tally ÷ NeMo alone: {ratio:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
