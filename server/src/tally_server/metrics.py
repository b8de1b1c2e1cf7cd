"""Prometheus metrics for one coordinator, exposed at ``GET /metrics`` on the HTTP port.

Counters and gauges are read from the service at scrape time (nothing on the delta path but the
plain integer increments the service already does); histograms are observed as events happen.
Every app gets its own :class:`~prometheus_client.CollectorRegistry`, so several coordinators in one
process (tests) never share or collide on series.

Labels are bounded: checkpoint names, RPC methods, route templates, status codes — never a source,
task, writer id or handle.

No ``_created`` series: prometheus_client adds one per counter and histogram child (OpenMetrics
wants them; the text format does not), which doubles the series of every histogram for a timestamp
nobody graphs. :func:`new_registry` turns them off for the process before any metric exists.
"""

from __future__ import annotations

import platform
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tally_server.service import CoordinatorService
    from tally_server.store.postgres import StoreLock

import tally_server
from tally_server.domain import idmap

__all__ = ["CONTENT_TYPE", "BuildInfo", "Metrics", "ServiceCollector", "new_registry"]

# What generate_latest writes, and what every Prometheus version parses (newer clients call their
# default 1.0.0, which older servers do not know).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Request latencies: sub-millisecond are/are-completed calls up to flushes that wait for a settle window.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# One fsynced LMDB transaction per touched file: around a millisecond on local disks, far more on NFS.
COMMIT_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Sources per group commit: 1 when idle, up to ~100k when a big batch completes at once.
BATCH_BUCKETS = (
    1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 50_000, 100_000,
)  # fmt: skip


def new_registry() -> CollectorRegistry:
    """A registry with ``tally_build_info``; ``_created`` series are turned off (process-wide)."""
    disable_created_metrics()  # type: ignore[no-untyped-call]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BuildInfo())
    return registry


class BuildInfo(Collector):
    """``tally_build_info{version, python, ledger_core}``: always 1, for "which version runs where".

    ``ledger_core``: ``compiled`` or ``python``, the counting core new writers get (domain/idmap.py).
    """

    def collect(self) -> Iterable[Metric]:
        """The one series."""
        info = GaugeMetricFamily(
            "tally_build_info",
            "Always 1; labels: the tally-server version, the Python version running it, and the "
            "counting core live writers run on (compiled or python).",
            labels=["version", "python", "ledger_core"],
        )
        info.add_metric([tally_server.__version__, platform.python_version(), idmap.current().name], 1)
        yield info


class ServiceCollector(Collector):
    """Turns ``service.stats`` and ``service.gauges()`` into metric families at each scrape.

    Runs on the event loop (the ``/metrics`` handler is async), the only thread that touches them.
    ``data_dir``: whose file system's free and total bytes to report (None: no such series).
    """

    def __init__(self, service: CoordinatorService, data_dir: Path | None = None) -> None:
        self._service = service
        self._data_dir = data_dir

    def collect(self) -> Iterable[Metric]:
        """The metric families at this scrape."""
        stats = self._service.stats
        deltas = CounterMetricFamily(
            "tally_deltas",
            "Deltas received from writers, by what the counting rules did with them "
            "(applied; skipped as a retry; rewritten with a different delta).",
            labels=["outcome"],
        )
        deltas.add_metric(["applied"], stats.deltas_applied)
        deltas.add_metric(["skipped"], stats.deltas_skipped)
        deltas.add_metric(["rewritten"], stats.deltas_rewritten)
        yield deltas
        gauges = sorted(self._service.gauges().items())
        anomalies = CounterMetricFamily(
            "tally_anomalies",
            "Deltas for a source already completed, by checkpoint; the source was un-completed and replays.",
            labels=["checkpoint"],
        )
        completions = CounterMetricFamily(
            "tally_completions",
            "Sources completed and durably written to their writer's LMDB file, by checkpoint.",
            labels=["checkpoint"],
        )
        # A series from 0 for every loaded checkpoint, so increase() sees its first completion.
        known = {name for name, _ in gauges} | stats.completions.keys() | stats.anomalies.keys()
        for name in sorted(known):
            anomalies.add_metric([name], stats.anomalies[name])
            completions.add_metric([name], stats.completions[name])
        yield anomalies
        yield completions
        yield CounterMetricFamily("tally_writers_opened", "Writers opened.", value=stats.writers_opened)
        yield CounterMetricFamily(
            "tally_writers_expired",
            "Writers whose lease ran out (they stopped sending; their pending state was dropped).",
            value=stats.writers_expired,
        )

        yield CounterMetricFamily(
            "tally_store_commit_failures",
            "Group commits of completions that failed (e.g. a full disk); their sources are retried.",
            value=stats.commit_failures,
        )
        yield CounterMetricFamily(
            "tally_files_quarantined",
            "Writers' own completion files found damaged when written, moved to the trash and replaced "
            "by a fresh file.",
            value=stats.files_quarantined,
        )
        errors = CounterMetricFamily(
            "tally_background_errors",
            "Failed steps of the coordinator's background loops (each is retried at its next interval).",
            labels=["loop"],
        )
        for loop, count in sorted(self._service.loop_errors().items()):
            errors.add_metric([loop], count)
        yield errors
        yield CounterMetricFamily(
            "tally_registry_events_dropped",
            "Events dropped because the registry database could not take them for too long.",
            value=self._service.registry_events_dropped,
        )
        yield CounterMetricFamily(
            "tally_lease_clock_paused_seconds",
            "Time not counted against leases and settle windows because the coordinator's event loop "
            "was stalled or saturated (it could not have heard heartbeats).",
            value=self._service.stall_clock.paused_s,
        )
        yield CounterMetricFamily(
            "tally_batches_resent",
            "Batches a client sent again (it did not hear the answer); recognised and not applied twice.",
            value=stats.batches_resent,
        )
        yield CounterMetricFamily(
            "tally_writers_restored",
            "Writers brought back from the journal when the coordinator started.",
            value=stats.writers_restored,
        )
        yield CounterMetricFamily(
            "tally_deltas_refused",
            "Deltas not applied because another live writer held a claim on their source.",
            value=stats.deltas_refused,
        )
        yield GaugeMetricFamily(
            "tally_journal_bytes",
            "Disk space the writers' journal takes.",
            value=self._service.journal_bytes(),
        )
        yield GaugeMetricFamily(
            "tally_journal_memory_bytes",
            "Memory the writers' journal's live state takes in the coordinator (the journal log keeps "
            "it in memory; 0 on PostgreSQL). Counted against TALLY_CHECKPOINT_MEMORY_MB.",
            value=self._service.journal_memory_bytes(),
        )
        yield GaugeMetricFamily(
            "tally_journal_entries",
            "Entries in the writers' journal (snapshots keep it within a few per writer's state).",
            value=self._service.journal_entries(),
        )
        yield GaugeMetricFamily(
            "tally_ready",
            "1 while the coordinator is ready (accepting work, persisting completions, loops healthy).",
            value=1 if self._service.ready else 0,
        )

        families = {
            "live_writers": GaugeMetricFamily(
                "tally_live_writers", "Open writers per checkpoint.", labels=["checkpoint"]
            ),
            "pending_sources": GaugeMetricFamily(
                "tally_pending_sources",
                "Sources with work in flight across the live writers of a checkpoint.",
                labels=["checkpoint"],
            ),
            "completed_sources": GaugeMetricFamily(
                "tally_completed_sources", "Sources completed in a checkpoint.", labels=["checkpoint"]
            ),
            "unreadable_files": GaugeMetricFamily(
                "tally_unreadable_files",
                "Completion files of a checkpoint that could not be read (their sources count as not "
                "completed).",
                labels=["checkpoint"],
            ),
            "claimed_sources": GaugeMetricFamily(
                "tally_claimed_sources",
                "Sources of a checkpoint live writers hold a claim on (Acquire).",
                labels=["checkpoint"],
            ),
            "remembered_tasks": GaugeMetricFamily(
                "tally_remembered_tasks",
                "Task ids the live writers of a checkpoint remember, so that a task fired again is "
                "skipped: each takes about 140 bytes of the coordinator's memory with the compiled "
                "counting core, 185 with --ledger-core python (its writer's tables, the journal's live "
                "state, its share of the completions) until its writer closes.",
                labels=["checkpoint"],
            ),
            "loaded_bytes": GaugeMetricFamily(
                "tally_checkpoint_loaded_bytes",
                "Estimated memory of a checkpoint's completed set while loaded (0 when unloaded).",
                labels=["checkpoint"],
            ),
        }
        # Declared totals: only checkpoints with a total (and a known remaining) have these series.
        declared = GaugeMetricFamily(
            "tally_declared_sources",
            "Sources declared for a checkpoint (its total); no series without a declaration.",
            labels=["checkpoint"],
        )
        remaining = GaugeMetricFamily(
            "tally_remaining_sources",
            "Declared sources of a checkpoint not completed yet; no series while not known.",
            labels=["checkpoint"],
        )
        for name, g in gauges:
            for field, family in families.items():
                family.add_metric([name], getattr(g, field))
            if g.declared_sources:
                declared.add_metric([name], g.declared_sources)
            if g.declared_sources and g.remaining_sources >= 0:
                remaining.add_metric([name], g.remaining_sources)
        yield from families.values()
        yield declared
        yield remaining
        if self._data_dir is not None:
            yield from _disk(self._data_dir)


def _disk(data_dir: Path) -> Iterable[Metric]:
    """Free and total bytes of the data directory's file system (one statvfs call)."""
    try:
        usage = shutil.disk_usage(data_dir)
    except OSError:
        return  # the directory went away: no series, rather than a failed scrape
    yield GaugeMetricFamily(
        "tally_data_dir_free_bytes",
        "Bytes free to unprivileged users on the file system of the data directory.",
        value=usage.free,
    )
    yield GaugeMetricFamily(
        "tally_data_dir_size_bytes",
        "Size in bytes of the file system of the data directory.",
        value=usage.total,
    )


class Metrics:
    """The registry of one coordinator and the histograms its transports and store observe.

    Create once in the composition root and hand it to both transports. ``data_dir``: see
    :class:`ServiceCollector`.
    """

    def __init__(self, service: CoordinatorService, data_dir: Path | None = None) -> None:
        self.registry = new_registry()
        self.registry.register(ServiceCollector(service, data_dir))
        ProcessCollector(registry=self.registry)
        self.grpc_request_duration = Histogram(
            "tally_grpc_request_duration_seconds",
            "Time to answer a unary gRPC call, by full method name and status code.",
            ["method", "code"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.http_request_duration = Histogram(
            "tally_http_request_duration_seconds",
            "Time to answer an HTTP request, by method, route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.commit_duration = Histogram(
            "tally_store_commit_duration_seconds",
            "Duration of one group commit of completions to the LMDB files (synced).",
            registry=self.registry,
            buckets=COMMIT_BUCKETS,
        )
        self.commit_batch_sources = Histogram(
            "tally_store_commit_batch_sources",
            "Sources written or deleted by one group commit.",
            registry=self.registry,
            buckets=BATCH_BUCKETS,
        )
        service.stats.commit_observers.append(self._observe_commit)

    def watch_store_lock(self, lock: StoreLock) -> None:
        """``tally_store_lease_renew_seconds``: each renewal of the PostgreSQL store's lock (owners only).

        A standby takes over from a holder silent for ``TAKE_OVER_AFTER_S``: renewals that take a
        good part of that are worth an alert before they cost a failover.
        """
        renew = Histogram(
            "tally_store_lease_renew_seconds",
            "Time one renewal of the PostgreSQL store's lock took (once a second, on its own session).",
            registry=self.registry,
            buckets=COMMIT_BUCKETS,
        )
        lock.renew_observers.append(renew.observe)

    def forwarding(self) -> Counter:
        """``tally_forwarded_calls_total``: calls of other shards forwarded to their holders."""
        return Counter(
            "tally_forwarded_calls",
            "Calls this coordinator forwarded to the coordinator holding their shard, by transport and "
            "outcome (ok, refused, unreachable).",
            ["transport", "outcome"],
            registry=self.registry,
        )

    def _observe_commit(self, seconds: float, ops: int, sources: int) -> None:
        self.commit_duration.observe(seconds)
        self.commit_batch_sources.observe(sources)

    def exposition(self) -> bytes:
        """The text exposition format of everything in the registry."""
        return generate_latest(self.registry)
