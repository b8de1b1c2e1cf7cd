"""The README's tour runs as written against a real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tally_server.testing import RunningServer

REPO = Path(__file__).resolve().parents[2]


def worker_script() -> str:
    readme = (REPO / "README.md").read_text()
    tour = readme.split("**2. Run a worker**", 1)[1]
    match = re.search(r"```python\n(.*?)```", tour, re.S)
    assert match, "the tour's worker script is missing"
    return match.group(1)


def test_readme_worker_runs_then_skips_everything(server: RunningServer, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(worker_script())
    env = {**os.environ, "TALLY_ADDRESS": server.grpc_address}
    outputs = [
        subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
        for _ in range(2)
    ]
    assert [o.returncode for o in outputs] == [0, 0], [o.stderr for o in outputs]
    assert outputs[0].stdout.strip() == "processed 10, skipped 0"
    assert outputs[1].stdout.strip() == "processed 0, skipped 10"
    status = httpx.get(f"{server.http_url}/v1/checkpoints/demo/run-1").json()
    assert status["name"] == "demo/run-1"
    assert (status["completed_count"], status["live_writers"], status["pending_sources"]) == (10, 0, 0)
