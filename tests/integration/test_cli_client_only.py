"""The operator commands ship with the SDK (``tally-client[cli]``) and need nothing of the server.

Each command runs in a fresh interpreter in which the server's packages cannot be imported, as on
an operator's laptop with only ``pip install 'tally-client[cli]'``: every ``tally`` command of
docs/nemo-curator.md must work there against a real coordinator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tally
from tally_server.testing import RunningServer
from tests.integration.workload import nemo_read, tree

# What an SDK-only environment lacks; importing any of them raises ImportError there.
SERVER_ONLY = (
    "tally_server",
    "fastapi",
    "starlette",
    "uvicorn",
    "sqlalchemy",
    "psycopg",
    "pydantic_settings",
)


def tally_cli(
    *args: str, missing: tuple[str, ...] = SERVER_ONLY, address: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``tally ARGS`` as the console script runs it, with ``missing`` packages unimportable."""
    code = (
        "import atexit, json, sys\n"
        f"for name in {list(missing)!r}:\n"
        "    sys.modules[name] = None\n"
        "def dump():\n"
        "    names = sorted(k for k, v in sys.modules.items() if v is not None)\n"
        "    print('MODULES ' + json.dumps(names), file=sys.stderr)\n"
        "atexit.register(dump)\n"
        f"sys.argv = ['tally', *{list(args)!r}]\n"
        "from tally.cli import main\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    env.update(COLUMNS="200", TALLY_TIMEOUT="5")
    if address is not None:
        env["TALLY_ADDRESS"] = address
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def loaded(result: subprocess.CompletedProcess[str]) -> list[str]:
    line = next(line for line in result.stderr.splitlines() if line.startswith("MODULES "))
    return list(json.loads(line.removeprefix("MODULES ")))


def message(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if not line.startswith("MODULES ")]


def test_every_command_of_the_nemo_curator_guide_runs_with_the_sdk_alone(
    server: RunningServer, tmp_path: Path
) -> None:
    with tally.Client(server.grpc_address) as client:
        client.declare("laptop/run", ["a", "b", "p", "q"])
        client.set_max_attempts("laptop/run", 1)
        with client.writer("laptop/run", writer_id="w") as w:
            w.apply_deltas(tree("a") + tree("b") + [("0_p", "p", 1)])
            w.report_failure("q", "oom")
    address = server.grpc_address
    status = tally_cli("status", "laptop/run", "--address", address)
    assert status.returncode == 0, status.stderr
    assert "completed" in status.stdout and "laptop/run" in status.stdout
    watch = tally_cli("watch", "laptop/run", "--once", address=address)
    assert watch.returncode == 0 and "laptop/run: completed 2" in watch.stdout, watch.stderr
    remaining = tally_cli("remaining", "laptop/run", "--address", address)
    assert remaining.returncode == 0 and remaining.stdout.split() == ["p", "q"], remaining.stderr
    failed = tally_cli("failed", "laptop/run", "--address", address)
    assert failed.returncode == 0 and "oom" in failed.stdout, failed.stderr
    retried = tally_cli("retry", "laptop/run", "q", "--address", address)
    assert retried.returncode == 0, retried.stderr
    run_folder = tmp_path / "run"  # what NeMo Curator leaves in checkpoint_path in SLURM-array mode
    (run_folder / ".nemo_curator_metadata" / ".slurm_array_completion").mkdir(parents=True)
    (run_folder / ".nemo_curator_metadata" / ".slurm_array_completion" / "run.json").write_text("{}\n")
    exported = tally_cli(
        "export", "laptop/run", str(tmp_path / "out"), "--markers-from", str(run_folder), "--address", address
    )
    assert exported.returncode == 0, exported.stderr
    assert nemo_read(tmp_path / "out") == {"a", "b"}
    assert (tmp_path / "out" / ".nemo_curator_metadata" / ".slurm_array_completion" / "run.json").is_file()
    imported = tally_cli("import", str(tmp_path / "out"), "--as", "laptop/copy", "--address", server.http_url)
    assert imported.returncode == 0 and "imported 2 new of 2" in imported.stdout, imported.stderr
    inspected = tally_cli("inspect", str(tmp_path / "out"))
    assert inspected.returncode == 0 and "completed sources: 2" in inspected.stdout
    for args in (["writers", "laptop/run", "--all"], ["events", "laptop/run"], ["status"]):
        result = tally_cli(*args, address=address)
        assert result.returncode == 0, (args, result.stderr)
    for result in (status, watch, remaining, failed, retried, exported, imported, inspected):
        assert not [m for m in loaded(result) if m.split(".")[0] in SERVER_ONLY]


def test_serve_without_the_server_says_what_to_install() -> None:
    result = tally_cli("serve", "--data-dir", "/nowhere")
    assert result.returncode == 1
    (line,) = message(result)
    assert line.startswith("error: tally serve runs the coordinator, which is the tally-server distribution")
    assert "pip install ./client ./server" in line


def test_without_the_cli_extra_tally_prints_one_line() -> None:
    for missing in ("typer", "rich", "lmdb"):
        result = tally_cli("status", missing=(missing,))
        assert result.returncode == 1
        assert message(result) == [
            "tally: the command line is the SDK's extra; install it with: pip install 'tally-client[cli]' "
            f"({missing} is missing)"
        ]


def test_with_the_server_installed_the_operator_commands_stay_light(server: RunningServer) -> None:
    # `tally serve` is discovered through the server's entry point, which loads only its cli module.
    result = tally_cli("status", missing=(), address=server.grpc_address)
    assert result.returncode == 0, result.stderr
    heavy = {"fastapi", "sqlalchemy", "psycopg", "uvicorn", "pydantic_settings"}
    assert not [m for m in loaded(result) if m.split(".")[0] in heavy]
    assert "tally_server.cli" in loaded(result)


def test_one_tally_command_lists_serve_where_the_server_is_installed() -> None:
    listing = tally_cli("--help", missing=())
    assert listing.returncode == 0 and "serve" in listing.stdout and "status" in listing.stdout
    serve = tally_cli("serve", "--help", missing=())
    assert serve.returncode == 0 and "--grpc-listen" in serve.stdout, serve.stderr
