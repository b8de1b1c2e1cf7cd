"""Start a real ``tally serve`` process on free ports, for tests and for users' own test suites.

with running_server(settle_ms=0) as server:
    client = tally.Client(server.grpc_address)

With ``tls_cert``/``tls_key`` it serves TLS: use ``server.grpc_url`` / ``server.http_url`` (``grpcs://``,
``https://``) and the client's ``ca_cert``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunningServer:
    """A ``tally serve`` subprocess started by ``running_server``, and where to reach it."""

    process: subprocess.Popen[str]
    grpc_address: str
    http_address: str
    data_dir: Path
    log_path: Path
    stdout_lines: list[str] = field(default_factory=list)
    tls: bool = False

    @property
    def http_url(self) -> str:
        """The HTTP base URL (https with TLS)."""
        return f"{'https' if self.tls else 'http'}://{self.http_address}"

    @property
    def grpc_url(self) -> str:
        """The gRPC address as a URL (grpcs with TLS)."""
        return f"{'grpcs' if self.tls else 'grpc'}://{self.grpc_address}"

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM and wait: the graceful path (flush everything, exit 0)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> int:
        """SIGKILL: the crash path."""
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait(30)

    def log(self) -> str:
        """The server's log so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _command() -> list[str]:
    script = Path(sys.executable).parent / "tally"
    if script.exists():
        return [str(script), "serve"]
    return [sys.executable, "-m", "tally_server", "serve"]


@contextlib.contextmanager
def running_server(
    data_dir: Path | str | None = None,
    *,
    settle_ms: int = 250,
    lease_ttl_s: float = 30.0,
    registry_url: str | None = None,
    store: str | None = None,
    grpc_listen: str = "127.0.0.1:0",
    http_listen: str = "127.0.0.1:0",
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    startup_timeout: float = 60.0,
    tls_cert: Path | str | None = None,
    tls_key: Path | str | None = None,
    tls_client_ca: Path | str | None = None,
    command: Sequence[str] | None = None,
) -> Iterator[RunningServer]:
    """Start ``tally serve`` on free loopback ports; yield its addresses; SIGTERM it on exit.

    ``tls_cert``/``tls_key`` (and ``tls_client_ca`` for mutual TLS) are PEM files to serve TLS with;
    ``store`` a PostgreSQL URL to keep completions and journals in (default: LMDB in the data dir).
    ``command``: what starts the server instead of this environment's ``tally serve`` (e.g. a
    checkout's ``["./dev", "serve"]``); the flags are appended to it all the same.
    """
    tls_files = {"--tls-cert": tls_cert, "--tls-key": tls_key, "--tls-client-ca": tls_client_ca}
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="tally-test-"))
        data = Path(data_dir)
        data.mkdir(parents=True, exist_ok=True)
        log_path = data / "tally-serve.log"
        argv = [
            *(command if command is not None else _command()),
            "--data-dir",
            str(data),
            "--grpc-listen",
            grpc_listen,
            "--http-listen",
            http_listen,
            "--settle-ms",
            str(settle_ms),
            "--lease-ttl-s",
            str(lease_ttl_s),
            *(["--registry-url", registry_url] if registry_url else []),
            *(["--store", store] if store else []),
            *(part for flag, path in tls_files.items() if path is not None for part in (flag, str(path))),
            *(args or []),
        ]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        log_file = stack.enter_context(open(log_path, "a"))  # noqa: SIM115
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            env=full_env,
            stdin=subprocess.DEVNULL,
        )
        lines: list[str] = []
        found: dict[str, str] = {}
        ready = threading.Event()

        def read_stdout() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line.rstrip("\n"))
                for kind in ("grpc", "http"):
                    prefix = f"{kind} listening on "
                    if line.startswith(prefix):
                        found[kind] = line[len(prefix) :].strip()
                if len(found) == 2:
                    ready.set()
            ready.set()  # process ended

        reader = threading.Thread(target=read_stdout, name="tally-serve-stdout", daemon=True)
        reader.start()
        server = RunningServer(process, "", "", data, log_path, lines, tls=tls_cert is not None)
        try:
            if not ready.wait(startup_timeout) or len(found) != 2:
                process.kill()
                process.wait(30)
                raise RuntimeError(
                    f"tally serve did not start (exit {process.poll()}); log:\n{server.log()[-4000:]}"
                )
            server.grpc_address, server.http_address = found["grpc"], found["http"]
            yield server
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(30)
            reader.join(10)
            if process.stdout is not None:
                process.stdout.close()
