"""``bench/nemo_enter.py --rounds 1`` end to end: the drop-in's start cost beside NeMo Curator's own.

A private Ray head, a real ``tally serve``, NeMo Curator 1.4.0's real ``create_resumability_actor``
(``.venv-nemo``). Nothing here looks at how fast anything was, only that each figure was measured,
that NeMo Curator adopted the drop-in's actor, and that the Ray head is gone afterwards.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_compare_smoke import REPO, _pids_with_env, _require_nemo_venv

pytestmark = [pytest.mark.nemo, pytest.mark.timeout(300)]

SECONDS = re.compile(r"^\d+\.\d\d s \(\d+\.\d\d–\d+\.\d\d\)$")


def test_one_round_measures_both_sides_and_every_phase() -> None:
    _require_nemo_venv()
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "nemo_enter.py"), "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert run.returncode == 0, f"nemo_enter.py failed ({run.returncode}):\n{run.stderr[-6000:]}"
    rows = {
        cells[0].strip(): cells[1:]
        for line in run.stdout.splitlines()
        if line.startswith("| ") and "---" not in line
        for cells in [[c.strip() for c in line.strip().strip("|").split("|")]]
    }
    for what in (
        "NeMo alone: its own actor start",
        "with Tally: enter + NeMo adopts",
        "entering the drop-in",
        "create actor + open writer",
        "NeMo adopting the proxy",
        "leaving the drop-in",
    ):
        assert what in rows, f"no row {what!r}:\n{run.stdout}"
        assert SECONDS.match(rows[what][0]), f"{what!r} was not measured: {rows[what]!r}"
    assert re.fullmatch(r"\d+\.\d–\d+\.\d", rows["NeMo alone: its own actor start"][1]), run.stdout
    assert re.search(r"^with Tally ÷ NeMo alone: \d+\.\d\d×$", run.stdout, re.M), run.stdout
    found = re.search(r"a private Ray head in (\S+)", run.stderr)
    assert found, run.stderr[-3000:]
    assert not Path(found.group(1)).exists()
    assert _pids_with_env(f"TALLY_BENCH_RAY={found.group(1)}") == []
