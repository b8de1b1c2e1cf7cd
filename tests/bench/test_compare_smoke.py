"""``bench/compare.py --tiny`` end to end, so that the side-by-side benchmark cannot rot.

Real ``tally serve`` processes, real SDK writers, NeMo Curator 1.4.0's real actor on a private Ray
instance (``.venv-nemo``, built by ``tests/nemo/setup_env.sh``). Toy sizes: the figures mean nothing
and nothing here looks at how fast anything was, only that every figure of the table was measured
on both sides, that both counted one anomaly per source in the rerun, and that the Ray instance is
gone afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tally_server.domain import idmap

REPO = Path(__file__).resolve().parents[2]
NEMO_VENV = REPO / ".venv-nemo"

pytestmark = [pytest.mark.nemo, pytest.mark.timeout(600)]

SECTIONS = [
    "Durable completions",
    "Deltas, all +1",
    "One small call",
    "A checkpoint of 10,000",
    "10 live writers",
    "A rerun over completed sources",
]
# A growth may be negative (memory given back): "-3 MB" is measured too; "-0 MB" is not printed.
NUMBER = re.compile(r"^-?\d[\d,.]* ?(k/s|M/s|/s|ms|s|MB|B/id|µs|% of a core|anomalies|sources)\b")
TINY_SOURCES = 4 * 50  # compare.py's tiny size: 4 writers × 50 sources


def _require_nemo_venv() -> None:
    if (NEMO_VENV / "bin" / "python").exists() and (NEMO_VENV / ".installed-nemo-curator-1.4.0").exists():
        return
    reason = (
        f"{NEMO_VENV.name}/ is not set up: run tests/nemo/setup_env.sh (or TALLY_NEMO_TESTS=1 ./dev test)"
    )
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the benchmark's smoke test, but {reason}")
    pytest.skip(reason)


def _rows(table: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split(" | ")]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith(("| **", "| figure ")) and "---" not in line
    ]


def _pids_with_env(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_tiny_run_measures_every_figure_on_both_sides_and_stops_ray() -> None:
    _require_nemo_venv()
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "compare.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=REPO,
    )
    assert run.returncode == 0, f"compare.py --tiny failed ({run.returncode}):\n{run.stderr[-6000:]}"
    out = run.stdout

    assert "anchor: NeMo Curator 1.4.0 ResumabilityActor, Ray " in out, out
    assert "load average before the run: " in out
    # The figures say which counting core Tally's servers ran (the environment chooses it).
    python = os.environ.get("TALLY_LEDGER_CORE") == "python" or idmap.COMPILED is None
    assert f"Tally's counting core: {'python' if python else 'compiled'} " in out
    for section in SECTIONS:
        assert re.search(rf"^\| \*\*{re.escape(section)}", out, re.M), f"no section {section!r}:\n{out}"

    rows = _rows(out)
    assert len(rows) > 40, out
    tally_cell = ""
    for figure, tally, anchor, ratio, _goal, load in rows:
        tally_cell = tally or tally_cell  # continuation rows compare the row above with another anchor
        if "journal on ÷ off" in figure:
            assert NUMBER.match(anchor.removeprefix("journal off: ")), f"journal off not measured: {anchor!r}"
        assert NUMBER.match(tally_cell), f"Tally's {figure or 'figure'} was not measured: {tally_cell!r}"
        if ":" in anchor:  # "<anchor>: <figure>"
            label, value = anchor.rsplit(": ", 1)
            assert NUMBER.match(value), f"the anchor's {label} figure was not measured: {anchor!r}"
        assert re.fullmatch(r"\d+\.\d–\d+\.\d / \d+", load), f"no load next to {figure!r}: {load!r}"
        assert ratio == "—" or ratio.endswith("×")

    # The small calls are printed beside their floor on this machine (bench/_floor.py), measured.
    for floor in ("a bare grpcio echo, no Tally", "a bare grpcio echo + one fdatasync"):
        assert re.search(rf"\| floor: {re.escape(floor)}: \d[\d.]* ms \| \d", out), out

    # The rerun: both sides counted one anomaly per source (each source's first delta), Tally on
    # its writers' close() and in the checkpoint's status, the anchor in its warnings.
    figures = [row[0] for row in rows]
    assert any(f.startswith("deltas/s, a rerun over completed sources") for f in figures), out
    counted = re.search(r"^\| anomalies in the rerun [^|]*\| ([\d,]+) anomalies \|", out, re.M)
    assert counted and int(counted.group(1).replace(",", "")) == TINY_SOURCES, out
    anchor_counts = re.findall(r"(Ray, 4 actors|Ray, 1 actor|class in-process): ([\d,]+) anomalies", out)
    arms = sorted(label for label, _ in anchor_counts)
    assert arms == ["Ray, 1 actor", "Ray, 4 actors", "class in-process"], anchor_counts
    assert {int(n.replace(",", "")) for _, n in anchor_counts} == {TINY_SOURCES}, anchor_counts
    status = re.search(r"^\| anomalies in the checkpoint's status [^|]*\| ([\d,]+) anomalies \|", out, re.M)
    assert status and int(status.group(1).replace(",", "")) == TINY_SOURCES, out

    # The private Ray instance is stopped and its directory removed.
    found = re.search(r"a local Ray instance in (\S+)", run.stderr)
    assert found, run.stderr[-3000:]
    ray_dir = found.group(1)
    assert not Path(ray_dir).exists()
    assert _pids_with_env(f"TALLY_BENCH_RAY={ray_dir}") == []
