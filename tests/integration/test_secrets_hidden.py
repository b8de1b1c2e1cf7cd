"""A database password given to ``tally serve`` is never shown (issue #13, item 2).

Real processes on a fresh PostgreSQL database (trust auth: the password is accepted and ignored):
the store and registry URLs carry a password, and it must appear in no log line, no health or
metrics answer and no operator command's output; nor in the errors of a store or registry that
cannot be reached, or of a URL that is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

import tally
from tally_server.testing import running_server
from tests.conftest import free_ports
from tests.integration.workload import tree

pytestmark = pytest.mark.postgres

TALLY = str(Path(sys.executable).parent / "tally")
SECRET = "s3cr3t"


def with_password(url: str, password: str = SECRET) -> str:
    return sa.make_url(url).set(password=password).render_as_string(hide_password=False)


def run_tally(*args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    return subprocess.run([TALLY, *args], capture_output=True, text=True, env=clean, timeout=120, check=False)


def test_the_password_of_the_store_and_registry_urls_is_shown_nowhere(
    tmp_path: Path, postgres_url: str
) -> None:
    # libpq's spelling for the store, SQLAlchemy's for the registry (the same database).
    store = with_password(postgres_url).replace("postgresql+psycopg://", "postgresql://")
    registry = with_password(postgres_url, "r3g" + SECRET)
    seen: list[str] = []
    with (
        running_server(tmp_path / "owner", store=store, registry_url=registry, settle_ms=0) as owner,
        running_server(tmp_path / "replica", store=store, registry_url=registry, settle_ms=0) as replica,
    ):
        assert "serving as a replica" in replica.log(), replica.log()
        with tally.Client(replica.grpc_address) as client, client.writer("pw/run", writer_id="w1") as w:
            w.apply_deltas(tree("a"))
            w.flush()
        for server in (owner, replica):
            for path in ("/readyz", "/healthz", "/metrics", "/v1/replicas", "/v1/checkpoints", "/"):
                answer = httpx.get(f"http://{server.http_address}{path}")
                assert answer.status_code == 200, (path, answer.text)
                seen.append(answer.text)
            for command in ("status", "replicas"):
                done = run_tally(command, "--address", server.grpc_address)
                assert done.returncode == 0, done.stderr
                seen += [done.stdout, done.stderr]
        shown = "\n".join(seen)
        assert "pw/run" in shown and "store epoch 1" in shown  # the views did show the service
    for server in (owner, replica):
        log = server.log()
        assert "owning store" in log or "serving as a replica" in log, log
        assert "shutdown complete" in log or "replica stopped" in log, log  # its last lines too
        seen.append(log)
    everything = "\n".join(seen)
    # The URLs are shown, their passwords masked.
    assert "postgresql+psycopg://postgres:***@127.0.0.1" in everything
    assert SECRET not in everything


def unreachable(password: str = SECRET) -> str:
    (port,) = free_ports(1)  # nothing listens there
    return f"postgresql://postgres:{password}@127.0.0.1:{port}/tally_nowhere"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--store", unreachable()],
            "tally serve: cannot use the PostgreSQL store postgresql+psycopg://postgres:***@",
        ),
        (
            ["--registry-url", unreachable()],
            "tally serve: cannot use the registry database postgresql://postgres:***@",
        ),
        (
            ["--store", f"mysql://root:{SECRET}@127.0.0.1/db"],
            "tally serve: --store is not valid: store 'mysql",
        ),
        (["--store", f"postgresql://root:{SECRET}@127.0.0.1:nope/db"], "tally serve: --store is not valid"),
        (["--store", f"root:{SECRET}@127.0.0.1/db"], "tally serve: --store is not valid"),
        (
            ["--registry-url", f"oracle://root:{SECRET}@127.0.0.1/db"],
            "tally serve: --registry-url is not valid: registry database 'oracle://root:***@",
        ),
        (["--registry-url", f"root:{SECRET}@127.0.0.1/db"], "tally serve: --registry-url is not valid"),
    ],
    ids=[
        "store-unreachable",
        "registry-unreachable",
        "store-not-postgres",
        "store-bad-port",
        "store-not-a-url",
        "registry-dialect",
        "registry-not-a-url",
    ],
)
def test_a_url_that_fails_is_one_line_without_its_password(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    listen = ["--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
    done = run_tally("serve", "--data-dir", str(tmp_path / "data"), *listen, *args)
    assert done.returncode in (1, 2), done.stderr
    assert done.stdout == ""  # it never said it was listening
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), done.stderr  # it said what was wrong
    assert SECRET not in done.stderr


@pytest.mark.parametrize("where", ["env", "file"])
def test_a_malformed_token_entry_is_one_line_that_never_repeats_it(tmp_path: Path, where: str) -> None:
    tokens = f"good-token:worker,{SECRET}-no-role"  # the second entry forgot its ':ROLE'
    listen = ["--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    if where == "env":
        env = {**clean, "TALLY_TOKENS": tokens}
    else:
        (tmp_path / "tokens").write_text(tokens.replace(",", "\n"))
        env = {**clean, "TALLY_TOKENS_FILE": str(tmp_path / "tokens")}
    command = [TALLY, "serve", "--data-dir", str(tmp_path / "data"), *listen]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode in (1, 2) and done.stdout == "", done.stderr
    (line,) = done.stderr.splitlines()
    assert "token entry 2 is not TOKEN:ROLE or TOKEN:ROLE@PREFIX" in line, line
    assert ("TALLY_TOKENS is not valid" if where == "env" else "cannot use the tokens file") in line, line
    assert SECRET not in line and "good-token" not in line
