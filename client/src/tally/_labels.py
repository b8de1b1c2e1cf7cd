"""Writer labels taken from the environment: which SLURM job, array task or NeMo Curator shard a
writer is, so ``tally writers`` and the dashboard tell them apart."""

from __future__ import annotations

import os
from collections.abc import Mapping

# SLURM job identity.
SLURM_LABELS = {
    "SLURM_JOB_ID": "slurm_job_id",
    "SLURM_ARRAY_JOB_ID": "slurm_array_job_id",
    "SLURM_ARRAY_TASK_ID": "slurm_array_task_id",
    "SLURM_ARRAY_TASK_COUNT": "slurm_array_task_count",
}

# NeMo Curator 1.4.0's own sharding of the source stage (nemo_curator.backends.slurm_array), which
# a launcher may set instead of (or besides) SLURM's array variables.
NEMO_CURATOR_SHARD_LABELS = {
    "NEMO_CURATOR_SLURM_ARRAY_SHARD_INDEX": "nemo_curator_shard_index",
    "NEMO_CURATOR_SLURM_ARRAY_TOTAL_SHARDS": "nemo_curator_total_shards",
    "NEMO_CURATOR_SLURM_ARRAY_MINIMUM_SHARD_INDEX": "nemo_curator_minimum_shard_index",
}
NEMO_CURATOR_SHARDING_ENABLED = "NEMO_CURATOR_SLURM_ARRAY_ENABLED"
# The values with which NeMo Curator turns its sharding off (SlurmArrayConfig.from_env).
_OFF = {"0", "false", "no", "off"}


def environment_labels(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Labels a writer gets from ``environ`` (``os.environ`` when None), before its own labels.

    SLURM's job and array ids, and NeMo Curator's shard index, total and minimum index when they are
    set and ``NEMO_CURATOR_SLURM_ARRAY_ENABLED`` does not turn NeMo Curator's sharding off.
    """
    env = os.environ if environ is None else environ
    labels = {label: env[var] for var, label in SLURM_LABELS.items() if env.get(var)}
    if env.get(NEMO_CURATOR_SHARDING_ENABLED, "1").strip().lower() not in _OFF:
        for var, label in NEMO_CURATOR_SHARD_LABELS.items():
            if env.get(var, "").strip():
                labels[label] = env[var].strip()
    return labels
