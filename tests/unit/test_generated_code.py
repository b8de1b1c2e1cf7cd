"""The committed protobuf modules are exactly what proto/generate.py produces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "proto" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


def test_check_fails_when_the_committed_code_differs(tmp_path: Path) -> None:
    # Copy the tree the script needs and damage one generated file: --check must notice.
    import shutil

    shutil.copytree(REPO / "proto", tmp_path / "proto")
    shutil.copytree(REPO / "client" / "src" / "tally" / "v1", tmp_path / "client" / "src" / "tally" / "v1")
    target = tmp_path / "client" / "src" / "tally" / "v1" / "coordinator_pb2.py"
    target.write_text(target.read_text() + "\n# edited by hand\n")
    result = subprocess.run(
        [sys.executable, str(tmp_path / "proto" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "stale" in result.stderr


def test_grpc_stubs_are_typed_for_sync_and_asyncio() -> None:
    # mypy-protobuf's stubs: without them every stub call in the SDK and the servicer is Any.
    stubs = (REPO / "client" / "src" / "tally" / "v1" / "coordinator_pb2_grpc.pyi").read_text()
    assert "class CoordinatorStub" in stubs and "class CoordinatorAsyncStub" in stubs
    assert "_aio.UnaryUnaryMultiCallable[_coordinator_pb2.ApplyDeltasRequest" in stubs
