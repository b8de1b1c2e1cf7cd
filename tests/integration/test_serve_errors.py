"""``tally serve`` that cannot start says why in one line and exits non-zero (issue 13).

Real processes: a coordinator holding its ports, a second one told to use them, and settings that
pydantic refuses, named as the user gave them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tally_server.testing import running_server

TALLY = str(Path(sys.executable).parent / "tally")


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    command = [TALLY, "serve", "--data-dir", str(tmp_path / "other"), *args]
    return subprocess.run(command, capture_output=True, text=True, env={**clean, **(env or {})}, timeout=60)


@pytest.mark.parametrize("wire", ["grpc", "http"])
@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_port_in_use_is_one_line_naming_it_and_how_to_choose_another(
    tmp_path: Path, wire: str, how: str
) -> None:
    with running_server(tmp_path / "first") as first:
        busy = first.grpc_address if wire == "grpc" else first.http_address
        listen = (
            {"grpc": busy, "http": "127.0.0.1:0"} if wire == "grpc" else {"grpc": "127.0.0.1:0", "http": busy}
        )
        if how == "flag":
            second = serve(tmp_path, "--grpc-listen", listen["grpc"], "--http-listen", listen["http"])
        else:
            second = serve(
                tmp_path, env={"TALLY_GRPC_LISTEN": listen["grpc"], "TALLY_HTTP_LISTEN": listen["http"]}
            )
    name, flag, env = {
        "grpc": ("gRPC", "--grpc-listen", "TALLY_GRPC_LISTEN"),
        "http": ("HTTP", "--http-listen", "TALLY_HTTP_LISTEN"),
    }[wire]
    assert second.returncode == 1
    assert second.stderr.splitlines() == [
        f"tally serve: cannot listen for {name} on {busy}: address already in use (by another tally "
        f"serve, or another program); choose another address with {flag} HOST:PORT or {env} (port 0 "
        "picks a free one)"
    ]
    assert second.stdout == ""  # it never said it was listening


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            [],
            {"TALLY_LEASE_TTL_S": "abc"},
            "TALLY_LEASE_TTL_S=abc is not valid: input should be a valid number, unable to parse string "
            "as a number",
        ),
        (
            ["--settle-ms", "-5"],
            {},
            "--settle-ms -5 is not valid: input should be greater than or equal to 0",
        ),
        (
            [],
            {"TALLY_LOG_FORMAT": "xml"},
            "TALLY_LOG_FORMAT=xml is not valid: input should be 'text' or 'json'",
        ),
        (
            [],
            {"TALLY_JOURNAL": "maybe"},
            "TALLY_JOURNAL=maybe is not valid: input should be a valid boolean, unable to interpret input",
        ),
        (
            [],
            {"TALLY_HTTP_LISTEN": "8080"},
            "TALLY_HTTP_LISTEN=8080 is not valid: listen address '8080' must be HOST:PORT (PORT 0 picks "
            "a free port)",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_variable_or_flag(
    tmp_path: Path, args: list[str], env: dict[str, str], line: str
) -> None:
    result = serve(tmp_path, "--grpc-listen", "127.0.0.1:0", *args, env=env)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"tally serve: {line}"]
    assert not (tmp_path / "other").exists()  # refused before anything was created


def test_a_secret_setting_is_named_but_never_echoed(tmp_path: Path) -> None:
    result = serve(tmp_path, "--store", "mysql://root:hunter2@db/x")
    assert result.returncode == 2
    assert result.stderr.startswith(
        "tally serve: --store is not valid: store 'mysql://root:***@db/x' uses 'mysql'"
    )
    assert "hunter2" not in result.stderr
    assert len(result.stderr.splitlines()) == 1
