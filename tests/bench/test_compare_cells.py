"""How `bench/compare.py` prints a figure: a number the readers (and the smoke test) can parse."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import compare  # noqa: E402  (bench/ holds the benchmark's scripts, not a package)


def test_a_value_that_rounds_to_zero_prints_without_a_minus() -> None:
    # A status read may leave the server's RSS a fraction of a MB lower (memory given back): the
    # CI's smoke test once failed on "-0 MB", which is neither a measurement nor a number.
    assert compare.cell([-0.3e6, -0.1e6, 0.2e6], "B") == "0 MB (0–0)"
    assert compare.cell([-0.004], "ms") == "0.00 ms"
    assert compare.cell([-3.2e6], "B") == "-3 MB"  # a real loss stays negative
    assert compare.cell([1.5e6, 2.4e6, 2.6e6], "B") == "2 MB (2–3)"
    assert compare.cell(None, "B") == "—"
