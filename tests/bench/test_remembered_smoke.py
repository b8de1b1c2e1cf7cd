"""``bench/remembered.py`` end to end, small: a real ``tally serve`` per core, each measured.

Nothing here looks at how much memory anything took (the benchmark's figures are for a quiet
machine and a long writer), only that both cores ran, alternately, and each printed a figure.
"""

from __future__ import annotations

import re
import subprocess
import sys

from tests.bench.test_compare_smoke import REPO
from tests.conftest import compiled_core_required

ROW = re.compile(r"^(compiled|python) +(-?\d+) +(-?\d+) +\d+\.\d / \d+$")


def test_each_core_is_measured_in_turn() -> None:
    compiled_core_required()
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "remembered.py"), "--sources", "3000"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "one live writer, 3,000 sources x 4 tasks, journal on"
    rows = [m.group(1) for line in lines if (m := ROW.match(line))]
    assert rows == ["compiled", "python", "compiled", "python"], run.stdout
