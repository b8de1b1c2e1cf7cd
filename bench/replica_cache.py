"""A replica's ``are_completed`` alone: ids/s, and CPU per id of the replica and of PostgreSQL.

    .venv/bin/python bench/replica_cache.py [--calls N] [--ids N] [--cache-ids N] [--pg-url URL]

Starts an owner and a replica (``tally serve --store``) on a scratch database, completes ``--ids``
sources, then one caller asks the replica for all of them (shuffled) ``--calls`` times, after 20
calls of warm-up. Prints one JSON line: ids/s, the replica process's CPU per id, the CPU per id of
the PostgreSQL backends serving the scratch database (those alive from start to end of the
measured calls; read from ``/proc``, so PostgreSQL must run on this machine), the load and the
replica's ``tally_replica_cache_*`` series. ``--cache-ids 0`` turns the
replica's cache off. To measure another checkout's server, put its ``client/src`` and
``server/src`` first on ``PYTHONPATH`` (the option is then ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa

import tally
from tally_server.testing import running_server


def cpu_seconds(pid: int | str) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backends(admin: sa.Engine, database: str) -> dict[int, float]:
    """CPU seconds so far of each PostgreSQL backend serving ``database`` (a PostgreSQL on this machine)."""
    with admin.connect() as conn:
        pids = conn.execute(
            sa.text("SELECT pid FROM pg_stat_activity WHERE datname = :name"), {"name": database}
        ).scalars()
        found = {}
        for pid in pids:
            try:
                found[int(pid)] = cpu_seconds(pid)
            except OSError:
                pass  # gone meanwhile
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--ids", type=int, default=1000)
    parser.add_argument("--cache-ids", type=int, default=2_000_000)
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    admin = sa.create_engine(args.pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    admin = admin.execution_options(isolation_level="AUTOCOMMIT")
    name = f"tally_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    env = {"TALLY_REPLICA_CACHE_IDS": str(args.cache_ids)}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="tally-bench-") as work,
            running_server(Path(work) / "owner", settle_ms=0, store=url) as owner,
            running_server(Path(work) / "replica", settle_ms=0, store=url, env=env) as replica,
        ):
            ids = [f"source-{i:07d}.jsonl" for i in range(args.ids)]
            with tally.Client(owner.grpc_address) as client, client.writer("bench/reads", writer_id="w") as w:
                w.apply_deltas([d for i, s in enumerate(ids) for d in ((f"t{i}", s, 1), (f"t{i}x", s, -1))])
                w.flush()
            random.Random(1).shuffle(ids)
            with tally.Client(replica.grpc_address) as client:
                for _ in range(20):
                    assert all(client.are_completed("bench/reads", ids))
                replica0, pg0, t0 = (
                    cpu_seconds(replica.process.pid),
                    backends(admin, name),
                    time.perf_counter(),
                )
                for _ in range(args.calls):
                    client.are_completed("bench/reads", ids)
                seconds = time.perf_counter() - t0
                replica_s = cpu_seconds(replica.process.pid) - replica0
                pg1 = backends(admin, name)
                pg_s = sum(pg1[pid] - pg0[pid] for pid in pg0.keys() & pg1.keys())
            asked = args.calls * len(ids)
            metrics = httpx.get(f"http://{replica.http_address}/metrics").text.splitlines()
            print(
                json.dumps(
                    {
                        "ids_per_s": round(asked / seconds),
                        "replica_us_per_id": round(replica_s / asked * 1e6, 2),
                        "postgres_us_per_id": round(pg_s / asked * 1e6, 2),
                        "load": [round(x, 2) for x in os.getloadavg()],
                        "cache": dict(
                            line.split() for line in metrics if line.startswith("tally_replica_cache")
                        ),
                    }
                )
            )
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    main()
