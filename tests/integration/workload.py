"""Delta streams shaped like NeMo Curator's, shared by the integration and fault tests."""

from __future__ import annotations

from tests.nemo_format import nemo_read

__all__ = ["nemo_read", "tree"]


def tree(source: str) -> list[tuple[str, str, int]]:
    """One partition: read (+1), 1:1 stage (0), fan-out to 3 (+2), one child filtered (-1),
    two children written at the sink (-1 each)."""
    root = f"0_{source}"
    return [
        (root, source, 1),
        (f"{root}_0", source, 0),
        (f"{root}_0_0", source, 2),
        (f"{root}_0_0_0", source, -1),  # filtered slot
        (f"{root}_0_0_1", source, -1),  # sink
        (f"{root}_0_0_2", source, -1),  # sink
    ]
