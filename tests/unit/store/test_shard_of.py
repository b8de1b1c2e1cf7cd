"""A checkpoint's shard (``store.shards.shard_of``): part of the store's format, so pinned here."""

from __future__ import annotations

import pytest

from tally_server.store.shards import check_shard_count, shard_of


def test_a_checkpoints_shard_never_changes() -> None:
    # CRC-32 of the UTF-8 name, modulo the store's shard count: a change here moves checkpoints
    # between shards of every store already made, so these values are the format.
    assert [shard_of("cp/a", n) for n in (1, 2, 8, 256)] == [0, 0, 2, 2]
    assert [shard_of("nemo/run-1", n) for n in (1, 2, 8, 256)] == [0, 1, 5, 37]
    assert [shard_of("datasets/common-crawl/2024", n) for n in (1, 8, 256)] == [0, 6, 6]
    assert [shard_of("é", n) for n in (8, 256)] == [6, 62]  # UTF-8 bytes, not code points


def test_names_spread_over_every_shard() -> None:
    counts = [0] * 8
    for i in range(1000):
        counts[shard_of(f"run-{i}/checkpoint", 8)] += 1
    assert all(count > 0 for count in counts), counts
    assert max(counts) < 2 * min(counts), counts  # roughly even: 125 each on average


@pytest.mark.parametrize("count", [0, -1, 257, 1.5, True])
def test_a_shard_count_outside_1_to_256_is_refused(count: object) -> None:
    with pytest.raises(ValueError, match="1 to 256 shards"):
        check_shard_count(count)  # type: ignore[arg-type]


def test_shard_counts_1_to_256_are_accepted() -> None:
    assert [check_shard_count(n) for n in (1, 2, 256)] == [1, 2, 256]
