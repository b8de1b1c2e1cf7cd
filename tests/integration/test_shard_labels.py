"""Writers of shards launched with NeMo Curator's own variables are labelled with their shard.

NeMo Curator 1.4.0 shards its source stage by ``NEMO_CURATOR_SLURM_ARRAY_{ENABLED,SHARD_INDEX,
TOTAL_SHARDS,MINIMUM_SHARD_INDEX}`` as well as by SLURM's array variables; each shard's writer is
opened in a process of its own with those set, as a launcher would, and the coordinator reports the
labels to the SDK and to ``tally writers``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import tally
from tally._labels import environment_labels
from tally_server.testing import RunningServer
from tests.integration.test_cli import ok, row

CHECKPOINT = "nemo/sharded"

# One shard's process: open a writer, complete one source, close.
SHARD = """
import sys, tally
with tally.Client(sys.argv[1]) as client, client.writer(sys.argv[2], writer_id=sys.argv[3]) as w:
    w.apply_deltas([("0_" + sys.argv[3], sys.argv[3], 1), ("0_" + sys.argv[3] + "_0", sys.argv[3], -1)])
"""


def _shard(server: RunningServer, writer_id: str, **variables: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NEMO_CURATOR_", "TALLY_"))}
    env.update(variables)
    subprocess.run(
        [sys.executable, "-c", SHARD, server.grpc_address, CHECKPOINT, writer_id],
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )


def test_nemo_curator_shards_are_labelled_with_their_index_and_total(server: RunningServer) -> None:
    for index in range(3):
        _shard(
            server,
            f"shard-{index}",
            NEMO_CURATOR_SLURM_ARRAY_ENABLED="1",
            NEMO_CURATOR_SLURM_ARRAY_SHARD_INDEX=str(index + 4),
            NEMO_CURATOR_SLURM_ARRAY_TOTAL_SHARDS="3",
            NEMO_CURATOR_SLURM_ARRAY_MINIMUM_SHARD_INDEX="4",  # a resubmission of shards 4-6
        )
    # Switched off, NeMo Curator does not shard: no shard labels; SLURM's ids are still there.
    _shard(
        server,
        "unsharded",
        NEMO_CURATOR_SLURM_ARRAY_ENABLED="off",
        NEMO_CURATOR_SLURM_ARRAY_SHARD_INDEX="1",
        NEMO_CURATOR_SLURM_ARRAY_TOTAL_SHARDS="3",
        SLURM_JOB_ID="4242",
    )
    with tally.Client(server.grpc_address) as client:
        labels = {w.writer_id: dict(w.labels) for w in client.writers(CHECKPOINT, include_closed=True)}
    assert labels == {
        **{
            f"shard-{i}": {
                "nemo_curator_shard_index": str(i + 4),
                "nemo_curator_total_shards": "3",
                "nemo_curator_minimum_shard_index": "4",
            }
            for i in range(3)
        },
        "unsharded": {"slurm_job_id": "4242"},
    }
    out = ok("writers", CHECKPOINT, "--all", address=server.grpc_address)
    assert row(out, "shard-1")[3] == (
        "nemo_curator_minimum_shard_index=4 nemo_curator_shard_index=5 nemo_curator_total_shards=3"
    )


def test_which_variables_make_which_labels() -> None:
    # Set without the switch: NeMo Curator shards (it is on unless switched off), and so do the labels.
    assert environment_labels(
        {"NEMO_CURATOR_SLURM_ARRAY_SHARD_INDEX": " 2 ", "NEMO_CURATOR_SLURM_ARRAY_TOTAL_SHARDS": "8"}
    ) == {"nemo_curator_shard_index": "2", "nemo_curator_total_shards": "8"}
    for off in ("0", "false", "No", " OFF "):
        assert (
            environment_labels(
                {"NEMO_CURATOR_SLURM_ARRAY_ENABLED": off, "NEMO_CURATOR_SLURM_ARRAY_SHARD_INDEX": "2"}
            )
            == {}
        )
    assert environment_labels(
        {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "", "HOME": "/"}
    ) == {"slurm_array_job_id": "7", "slurm_array_task_id": "3"}
